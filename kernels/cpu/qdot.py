"""Integer dot products for int4 weights against int8-quantized activations.

A ``linear`` node with the ``xq`` attribute (docs/quantization.md) quantizes its input
rows to int8 in blocks of 32 along K (scale = max|x| / 127, round half to even, as
ggml's Q8_0 activations for its Q4_0 weights) and takes the products in integers: per
pair of 32-weight blocks one 64-byte multiply-add of the weight codes (0..15) with the
activation bytes into 16 int32 lanes, each lane the sum of four neighbouring products.
The float GEMV (gemm_tiles.gemv_q4) spent ~28 vector instructions on those 64
weights (nibble unpack, widen, convert, fma, per-group fold); here it is ~11.

The 4-byte lane sums are exact integers whatever instruction makes them, so every CPU
gives the same bits (the float part runs in a fixed 16 lanes): ``_dot64`` picks
``vpdpbusd`` (AVX-512 VNNI, or AVX-VNNI on 256-bit halves), ``vpmaddubsw`` +
``vpmaddwd`` (AVX2; no saturation: 15 * 127 * 2 < 32767), ``sdot`` (aarch64 dotprod;
codes 0..15 read as signed bytes are the same numbers) or plain widening multiplies,
from the features of the code being compiled: the host's for the JIT, the target's
for an AOT build (``BUILD_FEATURES``, set by packager/aot.py).

Layout of the quantized row (scratch, one row of x at a time; kp2 = K rounded up to
64): pair p's 64 bytes are [block 2p weights 0..15 | block 2p+1 0..15 | block 2p
16..31 | block 2p+1 16..31], the order in which one 32-byte load of packed int4
weights unpacks (low nibbles, then high: kernels/wtypes.py keeps weights j and j+16 in
byte j of a block). ``nc`` holds, per lane, -8 times the sum of its four activation
bytes: the products start from it, which takes the codes' offset of 8 off exactly.
``sx`` holds each lane's activation scale.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils
from numba.extending import intrinsic

from ..flags import HAS_BIAS
from .abi import XQ_BLOCK
from .jit import njit
from .kernels import linear_epilogue_row
from .simd import F32, I32, F32Vec, Ops, _elem_ptr, prefetch

LANES = 16
ROWS = 4  # output rows sharing each pass over the quantized x
BLOCK, PAIR = XQ_BLOCK, 2 * XQ_BLOCK  # the int4 group sizes are multiples of BLOCK
PREFETCH_BYTES = 12288  # as gemv.py

# LLVM features ("+avx2,+fma,...") the instruction choice follows: an AOT build's
# target's (packager/aot.py sets them), else EDGEPACK_DOT_FEATURES when set (a subset
# of the host's, to run another family here: tests/test_qdot.py; every family gives the
# same bits, so the JIT cache may hold any of them), else the JIT host's.
BUILD_FEATURES: list[str | None] = [os.environ.get("EDGEPACK_DOT_FEATURES")]

_V = Ops(LANES)
vload, vfma, vmul, vzero = _V.vload, _V.vfma, _V.vmul, _V.vzero
vsum, sload, sstore = _V.vsum_tree, _V.sload, _V.sstore

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)


def _vec(t, n):
    return ir.VectorType(t, n)


def _consts(t, values):
    return ir.Constant(_vec(t, len(values)), list(values))


def _features(context) -> frozenset[str]:
    raw = BUILD_FEATURES[0]
    if raw is None:
        raw = getattr(context.codegen(), "_tm_features", "") or ""
    return frozenset(f[1:] for f in raw.split(",") if f.startswith("+"))


def dot_isa(features: frozenset[str] | set[str]) -> str:
    """The instruction family ``_dot64`` uses for these LLVM features."""
    if "avx512vnni" in features and "avx512bw" in features:
        return "vnni512"
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= set(features):
        return "vnni256"
    if "avx2" in features:
        return "avx2"
    if "dotprod" in features:
        return "sdot"
    return "generic"


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _part(builder, v, lo, n):
    und = ir.Constant(v.type, ir.Undefined)
    return builder.shuffle_vector(v, und, _consts(I32, range(lo, lo + n)))


def _join(builder, parts):
    while len(parts) > 1:
        a, b = parts[0], parts[1]
        n = a.type.count
        parts = [builder.shuffle_vector(a, b, _consts(I32, range(2 * n)))] + parts[2:]
    return parts[0]


def _dot64(builder, isa: str, acc, u, s):
    """acc[l] + sum_{j<4} u[4l+j] * s[4l+j]: acc <16 x i32>, u unsigned and s signed
    <64 x i8>."""
    v16i32 = _vec(I32, 16)
    if isa == "vnni512":
        a = builder.bitcast(u, v16i32)
        b = builder.bitcast(s, v16i32)
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16i32, [acc, a, b])
    if isa == "vnni256":
        out = []
        for h in range(2):
            a = builder.bitcast(_part(builder, u, 32 * h, 32), _vec(I32, 8))
            b = builder.bitcast(_part(builder, s, 32 * h, 32), _vec(I32, 8))
            c = _part(builder, acc, 8 * h, 8)
            out.append(_call(builder, "llvm.x86.avx512.vpdpbusd.256", _vec(I32, 8), [c, a, b]))
        return _join(builder, out)
    if isa == "avx2":
        ones = _consts(_I16, [1] * 16)
        out = []
        for h in range(2):
            a, b = _part(builder, u, 32 * h, 32), _part(builder, s, 32 * h, 32)
            p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [a, b])
            p32 = _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [p16, ones])
            out.append(builder.add(_part(builder, acc, 8 * h, 8), p32))
        return _join(builder, out)
    if isa == "sdot":
        out = []
        for q in range(4):
            a, b = _part(builder, u, 16 * q, 16), _part(builder, s, 16 * q, 16)
            c = _part(builder, acc, 4 * q, 4)
            out.append(_call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(I32, 4),
                             [c, a, b]))  # fmt: skip
        return _join(builder, out)
    wide = _vec(I32, 64)
    p = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    total = acc
    for j in range(4):
        part = builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined),
                                      _consts(I32, range(j, 64, 4)))  # fmt: skip
        total = builder.add(total, part)
    return total


def _q4_dot_intrinsic(whole: bool):
    vt = F32Vec(LANES)

    @intrinsic
    def q4dot(typingctx, w, wo, xq, xo, nc, co):
        """The 16 lane sums of one pair of blocks as float32: the packed int4 bytes at w's
        flat offset wo (32 of them; ``q4dot1``: 16, one block, the second block's lanes
        are zeros), the pair's quantized activations at xq's offset xo, the lanes'
        starting values at nc's offset co (exact integers, converted at the end)."""

        def codegen(context, builder, sig, args):
            isa = dot_isa(_features(context))
            nb = 32 if whole else 16
            pw = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            raw = builder.load(builder.bitcast(pw, _vec(_I8, nb).as_pointer()), align=1)
            lo = builder.and_(raw, _consts(_I8, [15] * nb))
            hi = builder.lshr(raw, _consts(_I8, [4] * nb))
            if whole:
                codes = builder.shuffle_vector(lo, hi, _consts(I32, range(64)))
            else:  # [lo | zeros | hi | zeros]: lanes of the absent block multiply zeros
                z = ir.Constant(_vec(_I8, 16), [0] * 16)
                lo32 = builder.shuffle_vector(lo, z, _consts(I32, range(32)))
                hi32 = builder.shuffle_vector(hi, z, _consts(I32, range(32)))
                codes = builder.shuffle_vector(lo32, hi32, _consts(I32, range(64)))
            px = _elem_ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            xv = builder.load(builder.bitcast(px, _vec(_I8, 64).as_pointer()), align=1)
            pc = _elem_ptr(context, builder, sig.args[4], args[4], args[5], sig.args[5])
            acc = builder.load(builder.bitcast(pc, _vec(I32, 16).as_pointer()), align=4)
            return builder.sitofp(_dot64(builder, isa, acc, codes, xv), _vec(F32, LANES))

        return vt(w, wo, xq, xo, nc, co), codegen

    return q4dot


q4dot2, q4dot1 = _q4_dot_intrinsic(True), _q4_dot_intrinsic(False)


def _half_bits_to_f32_soft(builder, bits):
    """An fp16 (its i16 bits) as float32 in integer and float ops, exact for every finite
    half, normal or not: SSE-only x86 has no conversion instruction, and LLVM's fpext
    there calls a runtime helper numba does not link. The magnitude bits shifted into
    float32 position read as 2**-112 times the value; one multiply rebiases."""
    b = builder.zext(bits, I32)
    mag = builder.shl(builder.and_(b, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13))
    f = builder.fmul(builder.bitcast(mag, F32), ir.Constant(F32, 2.0**112))
    sign = builder.shl(builder.and_(b, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
    return builder.bitcast(builder.or_(builder.bitcast(f, I32), sign), F32)


def _spread_halves(builder, context, bits):
    """<2 x i16> fp16 scale bits as [s0 x4, s1 x4, s0 x4, s1 x4] float32 (the lanes each
    block's products occupy): vcvtph2ps (F16C) or fcvtl on aarch64, else the integer
    conversion (SSE-only x86)."""
    feats = _features(context)
    two = _vec(F32, 2)
    if "f16c" in feats or "avx512f" in feats or not any(f.startswith("sse") for f in feats):
        v = builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), 2)), two)
    else:
        v = ir.Constant(two, ir.Undefined)
        for i in range(2):
            e = builder.extract_element(bits, ir.Constant(I32, i))
            v = builder.insert_element(v, _half_bits_to_f32_soft(builder, e), ir.Constant(I32, i))
    pattern = [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    return builder.shuffle_vector(v, ir.Constant(two, ir.Undefined), _consts(I32, pattern))


@intrinsic
def vhalves2(typingctx, h, o0, o1):
    """The fp16 group scales (uint16 bits) h[o0] and h[o1] of a pair's two blocks, spread
    over the lanes that block's products occupy (``_spread_halves``)."""
    vt = F32Vec(LANES)

    def codegen(context, builder, sig, args):
        bits = ir.Constant(_vec(_I16, 2), ir.Undefined)
        for i in (1, 2):
            p = _elem_ptr(context, builder, sig.args[0], args[0], args[i], sig.args[i])
            bits = builder.insert_element(bits, builder.load(p), ir.Constant(I32, i - 1))
        return _spread_halves(builder, context, bits)

    return vt(h, o0, o1), codegen


@intrinsic
def vhalves2c(typingctx, h, o0):
    """vhalves2(h, o0, o0 + 1) from one 32-bit load (group size 32: a pair's two blocks
    have neighbouring scales)."""
    vt = F32Vec(LANES)

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        bits = builder.load(builder.bitcast(p, _vec(_I16, 2).as_pointer()), align=2)
        return _spread_halves(builder, context, bits)

    return vt(h, o0), codegen


@njit(inline="always")
def _scales2(scale, c, g0, g1, gsh):
    """A pair's lane scales (vhalves2), one load when the groups are 32 wide."""
    if gsh == 0:
        return vhalves2c(scale, c + g0)
    return vhalves2(scale, c + g0, c + g1)


@njit(inline="always")
def _quantize_row(x, xo, k_, xq, qo, nc, so, sx):
    """x's row at flat offset xo (k_ values) into int8 blocks of 32 in the pair layout
    (module doc) at xq's offset qo; the lanes' -8 * sums and scales at nc's and sx's
    offset so. Past k_ the row is zeros."""
    kp2 = (k_ + PAIR - 1) // PAIR * PAIR
    for p in range(kp2 // PAIR):
        for h in range(2):
            k0 = (2 * p + h) * BLOCK
            amax = np.float32(0)
            for j in range(BLOCK):
                if k0 + j < k_:
                    amax = max(amax, abs(sload(x, xo + k0 + j)))
            d = amax / np.float32(127)
            for j in range(BLOCK):
                v = sload(x, xo + k0 + j) if k0 + j < k_ else np.float32(0)
                q = np.rint(v / d) if d > 0 else np.float32(0)
                q = min(max(q, np.float32(-127)), np.float32(127))
                pos = p * PAIR + h * 16 + (j if j < 16 else 16 + j)
                sstore(xq, qo + pos, np.int8(q))
            for lane in range(4):
                sstore(sx, so + p * 16 + h * 4 + lane, d)
                sstore(sx, so + p * 16 + 8 + h * 4 + lane, d)
        for lane in range(16):
            t = np.int32(0)
            for j in range(4):
                t += np.int32(sload(xq, qo + p * PAIR + 4 * lane + j))
            sstore(nc, so + p * 16 + lane, np.int32(-8) * t)


@njit(parallel=True, cache=True)
def gemv_q4_q8(x, w, scale, bias, y, xq, nc, sx, flags, act, a, b):
    """y[M, N] = act(q8(x)[M, K] @ dequant(w)[:, :K].T + bias): w the packed int4 weights
    [N, Kp/2] (uint8), scale their fp16 group scales [N, Kp/G] as uint16 (wtypes.py);
    q8(x) its rows quantized into xq [M, kp2] (int8), nc and sx [M, kp2 / 4] (int32,
    float32), kp2 = Kp rounded up to 64 (scratch; module doc). Rows past N repeat the
    last (loads stay inside w); bias and activation are a pass of their own."""
    m_, k_ = x.shape
    n_, half = w.shape
    gs = scale.shape[1]
    kp = half * 2
    group = kp // gs
    kp2 = xq.shape[1]
    for m in range(m_):
        _quantize_row(x, m * k_, k_, xq, m * kp2, nc, m * (kp2 // 4), sx)
    pairs = kp // PAIR
    odd = kp % PAIR != 0
    gsh = 0  # block b's scale is group b >> gsh (group sizes are 32 * 2**gsh; a
    while BLOCK << gsh < group:  # division here cost two idivs a pair, a third of it)
        gsh += 1
    pf = max(ROWS, PREFETCH_BYTES // max(half, 1)) * half
    nb = (n_ + ROWS - 1) // ROWS
    for blk in prange(nb):
        n0 = blk * ROWS
        q1, q2, q3 = min(n0 + 1, n_ - 1), min(n0 + 2, n_ - 1), min(n0 + 3, n_ - 1)
        o0, o1, o2, o3 = n0 * half, q1 * half, q2 * half, q3 * half
        c0, c1, c2, c3 = n0 * gs, q1 * gs, q2 * gs, q3 * gs
        last = min(ROWS, n_ - n0)
        for m in range(m_):
            t0, t1, t2, t3 = vzero(), vzero(), vzero(), vzero()
            qo = m * kp2
            so = m * (kp2 // 4)
            for p in range(pairs):
                xo = qo + p * PAIR
                lo = so + p * 16
                lane = vload(sx, lo)
                g0 = (2 * p) >> gsh
                g1 = (2 * p + 1) >> gsh
                wb = p * BLOCK
                t0 = vfma(q4dot2(w, o0 + wb, xq, xo, nc, lo),
                          vmul(_scales2(scale, c0, g0, g1, gsh), lane), t0)
                t1 = vfma(q4dot2(w, o1 + wb, xq, xo, nc, lo),
                          vmul(_scales2(scale, c1, g0, g1, gsh), lane), t1)
                t2 = vfma(q4dot2(w, o2 + wb, xq, xo, nc, lo),
                          vmul(_scales2(scale, c2, g0, g1, gsh), lane), t2)
                t3 = vfma(q4dot2(w, o3 + wb, xq, xo, nc, lo),
                          vmul(_scales2(scale, c3, g0, g1, gsh), lane), t3)
                prefetch(w, o0 + wb + pf)
                prefetch(w, o1 + wb + pf)
                prefetch(w, o2 + wb + pf)
                prefetch(w, o3 + wb + pf)
            if odd:  # K ends one block into the last pair
                p = pairs
                xo = qo + p * PAIR
                lo = so + p * 16
                lane = vload(sx, lo)
                g0 = (2 * p) >> gsh
                wb = p * BLOCK
                t0 = vfma(q4dot1(w, o0 + wb, xq, xo, nc, lo),
                          vmul(vhalves2(scale, c0 + g0, c0 + g0), lane), t0)
                t1 = vfma(q4dot1(w, o1 + wb, xq, xo, nc, lo),
                          vmul(vhalves2(scale, c1 + g0, c1 + g0), lane), t1)
                t2 = vfma(q4dot1(w, o2 + wb, xq, xo, nc, lo),
                          vmul(vhalves2(scale, c2 + g0, c2 + g0), lane), t2)
                t3 = vfma(q4dot1(w, o3 + wb, xq, xo, nc, lo),
                          vmul(vhalves2(scale, c3 + g0, c3 + g0), lane), t3)
            yo = m * n_ + n0
            sstore(y, yo, vsum(t0))
            if last > 1:
                sstore(y, yo + 1, vsum(t1))
            if last > 2:
                sstore(y, yo + 2, vsum(t2))
            if last > 3:
                sstore(y, yo + 3, vsum(t3))
    if flags & HAS_BIAS or act != 0:  # no scale: the weights' are in the products
        for m in range(m_):
            linear_epilogue_row(y[m], bias, bias, flags & HAS_BIAS, act, a, b)
