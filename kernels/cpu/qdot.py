"""Integer dot products for int4 weights against int8-quantized activations.

A ``linear`` node with the ``xq`` attribute (docs/quantization.md) quantizes its input
rows to int8 in blocks of 32 along K (scale = max|x| / 127, round half to even, as
ggml's Q8_0 activations for its Q4_0 weights) and takes the products in integers: per
pair of 32-weight blocks, 64 byte products of the weight codes (0..15) with the
activation bytes summed into 8 int32 lanes (lanes 0-3 the first block, 4-7 the
second, eight products each), then one float multiply-add by the lanes' weight scale
times activation scale.

Register tiles: 1 output row x up to 4 rows of x (``_tile``; 4 accumulators, one
codes vector, one scale vector: no spills on AVX2's 16 registers, where 2 x 4 tiles
spilled and ran slower). Each pair's codes and scales are unpacked once for every row
of x in the tile, so a decode step of 8 sequences or a prompt chunk of 32 tokens no
longer unpacks every weight again per row; a parallel task takes 4 output rows with
the tile of x outside them, so the tile's quantized rows stay in L1. SmolLM2-135M's
int4 linears, 2 threads on a 2-core Zen 2 (AVX2): 1 row 4.7 -> 3.0 ms a step, 8 rows
26.9 -> 12.6 ms, 32 rows 99.6 -> 50.8 ms (the kernel this replaced looped over the
rows inside each block of 4 output rows and kept 16 float lanes a row).

The lane sums are exact integers whatever instruction makes them, so every CPU gives
the same bits (the float part runs in a fixed 8 lanes): ``_dot8`` picks
``vpdpbusd`` (AVX-512 VNNI, or AVX-VNNI / AVX-512VL on 256-bit halves), ``vpmaddubsw``
+ ``vpaddw`` + ``vpmaddwd`` (AVX2; no saturation: 15 * 127 * 2 * 2 < 32767), ``sdot``
(aarch64 dotprod; codes 0..15 read as signed bytes are the same numbers) or plain
widening multiplies, from the features of the code being compiled: the host's for the
JIT, the target's for an AOT build (``BUILD_FEATURES``, set by packager/aot.py).

The scratch holds a tile's rows pair by pair (pair p of the tile's rows together),
and full tiles with groups of 32 compile with both constant, so the tile's loop reads
x through one pointer plus constants and has no branch: 48 instructions a pair for
four rows on AVX2, where separate rows' pointers had spilled (32 rows 55 -> 50 ms).

Layout of a quantized row (scratch; kp2 = K rounded up to 64): pair p's 64 bytes are
[block 2p weights 0..15 | block 2p+1 0..15 | block 2p 16..31 | block 2p+1 16..31], the
order in which one 32-byte load of packed int4 weights unpacks (low nibbles, then
high: kernels/wtypes.py keeps weights j and j+16 in byte j of a block). Lane l sums
bytes 4l..4l+3 of each 32-byte half. ``nc`` holds, per pair and lane, -8 times the sum
of the lane's eight activation bytes: the products start from it, which takes the
codes' offset of 8 off exactly. ``sx`` holds each lane's activation scale.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ..flags import HAS_BIAS
from .abi import XQ_BLOCK
from .jit import njit
from .kernels import linear_epilogue_row
from .simd import F32, I32, F32Vec, Ops, _elem_ptr, prefetch

LANES = 8  # float lanes of a pair's sums: 4 per block
ROWS = 4  # output rows a parallel task takes, one at a time
MROWS = 4  # rows of x in a tile: one output row's codes unpacked once for the four
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
    """Equal-width vectors concatenated in order (2, 4, ... of them: joined pairwise,
    level by level, so both halves of every shuffle have one type)."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [builder.shuffle_vector(a, b, _consts(I32, range(2 * n)))
                 for a, b in zip(parts[0::2], parts[1::2])]  # fmt: skip
    return parts[0]


def _dot8(builder, isa: str, acc, u, s):
    """acc[l] + sum_{j<4} (u[4l+j] * s[4l+j] + u[32+4l+j] * s[32+4l+j]): acc <8 x i32>,
    u unsigned and s signed <64 x i8>. Lane l holds the same eight products whatever the
    instruction family, so the integer sums, and every float after them, are the same
    on every CPU."""
    v8i32 = _vec(I32, 8)
    halves = [(_part(builder, u, 32 * h, 32), _part(builder, s, 32 * h, 32)) for h in range(2)]
    if isa == "vnni512":  # one 512-bit vpdpbusd, then its halves added
        v16 = _vec(I32, 16)
        zero = ir.Constant(v16, [0] * 16)
        d = _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                  [zero, builder.bitcast(u, v16), builder.bitcast(s, v16)])  # fmt: skip
        return builder.add(acc, builder.add(_part(builder, d, 0, 8), _part(builder, d, 8, 8)))
    if isa == "vnni256":  # two 256-bit vpdpbusd chained on one accumulator
        for a, b in halves:
            a, b = builder.bitcast(a, v8i32), builder.bitcast(b, v8i32)
            acc = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, [acc, a, b])
        return acc
    if isa == "avx2":  # the i16 pair sums of both halves added before widening: no
        # saturation (|15 * 127 * 2 * 2| < 32767), one vpmaddwd instead of two
        p = [_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [a, b])
             for a, b in halves]  # fmt: skip
        ones = _consts(_I16, [1] * 16)
        p32 = _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [builder.add(p[0], p[1]), ones])
        return builder.add(acc, p32)
    if isa == "sdot":  # lanes 0-3 from bytes 0-15 and 32-47, lanes 4-7 from 16-31, 48-63
        out = []
        for q in range(2):
            c = _part(builder, acc, 4 * q, 4)
            for h in range(2):
                o = 32 * h + 16 * q
                a, b = _part(builder, u, o, 16), _part(builder, s, o, 16)
                c = _call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(I32, 4), [c, a, b])
            out.append(c)
        return _join(builder, out)
    wide = _vec(I32, 64)
    p = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    total = acc
    for h in range(2):
        for j in range(4):
            idx = [32 * h + 4 * lane + j for lane in range(8)]
            part = builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined), _consts(I32, idx))
            total = builder.add(total, part)
    return total


class I8x64(types.Type):
    """64 int8 weight codes (one pair of blocks) held in registers."""

    def __init__(self) -> None:
        super().__init__(name="i8x64")


@register_model(I8x64)
class _I8x64Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _vec(_I8, 64))


_CODES = I8x64()


def _codes_intrinsic(whole: bool):
    @intrinsic
    def q4codes(typingctx, w, wo):
        """One pair of blocks' int4 codes (0..15) in the quantized row's byte order
        (module doc), from the 32 packed bytes at w's flat offset wo (``q4codes1``: 16,
        one block; the second block's codes are zeros and nothing past it is read)."""

        def codegen(context, builder, sig, args):
            nb = 32 if whole else 16
            pw = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            raw = builder.load(builder.bitcast(pw, _vec(_I8, nb).as_pointer()), align=1)
            lo = builder.and_(raw, _consts(_I8, [15] * nb))
            hi = builder.lshr(raw, _consts(_I8, [4] * nb))
            if whole:
                return builder.shuffle_vector(lo, hi, _consts(I32, range(64)))
            z = ir.Constant(_vec(_I8, 16), [0] * 16)  # [lo | zeros | hi | zeros]
            lo32 = builder.shuffle_vector(lo, z, _consts(I32, range(32)))
            hi32 = builder.shuffle_vector(hi, z, _consts(I32, range(32)))
            return builder.shuffle_vector(lo32, hi32, _consts(I32, range(64)))

        return _CODES(w, wo), codegen

    return q4codes


q4codes, q4codes1 = _codes_intrinsic(True), _codes_intrinsic(False)


@intrinsic
def q8dot8(typingctx, c, xq, xo, nc, co):
    """The 8 lane sums (``_dot8``) of codes c with the 64 quantized activation bytes at
    xq's flat offset xo, starting from the 8 int32 at nc's offset co, as float32 (exact
    integers: |sum| < 2**24)."""

    def codegen(context, builder, sig, args):
        isa = dot_isa(_features(context))
        px = _elem_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2])
        xv = builder.load(builder.bitcast(px, _vec(_I8, 64).as_pointer()), align=1)
        pc = _elem_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4])
        acc = builder.load(builder.bitcast(pc, _vec(I32, 8).as_pointer()), align=4)
        return builder.sitofp(_dot8(builder, isa, acc, args[0], xv), _vec(F32, 8))

    return F32Vec(8)(c, xq, xo, nc, co), codegen


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
    """<2 x i16> fp16 scale bits as [s0 x4, s1 x4] float32 (the lanes each block's sums
    occupy): vcvtph2ps (F16C) or fcvtl on aarch64, else the integer conversion
    (SSE-only x86)."""
    feats = _features(context)
    two = _vec(F32, 2)
    if "f16c" in feats or "avx512f" in feats or not any(f.startswith("sse") for f in feats):
        v = builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), 2)), two)
    else:
        v = ir.Constant(two, ir.Undefined)
        for i in range(2):
            e = builder.extract_element(bits, ir.Constant(I32, i))
            v = builder.insert_element(v, _half_bits_to_f32_soft(builder, e), ir.Constant(I32, i))
    pattern = [0] * 4 + [1] * 4
    return builder.shuffle_vector(v, ir.Constant(two, ir.Undefined), _consts(I32, pattern))


@intrinsic
def vhalves2(typingctx, h, o0, o1):
    """The fp16 group scales (uint16 bits) h[o0] and h[o1] of a pair's two blocks, spread
    over the lanes that block's sums occupy (``_spread_halves``)."""
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
def _quantize_row(x, xo, k_, xq, qo, xstep, nc, so, cstep, sx):
    """x's row at flat offset xo (k_ values) into int8 blocks of 32 in the pair layout
    (module doc): pair p's 64 bytes at xq's offset qo + p * xstep, its 8 lanes' -8 *
    sums and scales at nc's and sx's offset so + p * cstep. Past k_ the row is zeros."""
    kp2 = (k_ + PAIR - 1) // PAIR * PAIR
    for p in range(kp2 // PAIR):
        xp, cp = qo + p * xstep, so + p * cstep
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
                sstore(xq, xp + h * 16 + (j if j < 16 else 16 + j), np.int8(q))
            for lane in range(4):
                sstore(sx, cp + h * 4 + lane, d)
        for lane in range(LANES):
            t = np.int32(0)
            for j in range(4):
                t += np.int32(sload(xq, xp + 4 * lane + j))
                t += np.int32(sload(xq, xp + 32 + 4 * lane + j))
            sstore(nc, cp + lane, np.int32(-8) * t)


@njit(inline="always")
def _rows4(w0, s0, xq, xo, kp2, nc, sx, lo, cs, rows, t0, t1, t2, t3):
    """One pair's codes w0 and lane scales s0 against ``rows`` (1 to 4) quantized rows
    of x (the first at xq's offset xo, nc's and sx's lo; row strides kp2 and cs)."""
    t0 = vfma(q8dot8(w0, xq, xo, nc, lo), vmul(s0, vload(sx, lo)), t0)
    if rows > 1:
        t1 = vfma(q8dot8(w0, xq, xo + kp2, nc, lo + cs), vmul(s0, vload(sx, lo + cs)), t1)
    if rows > 2:
        t2 = vfma(q8dot8(w0, xq, xo + 2 * kp2, nc, lo + 2 * cs),
                  vmul(s0, vload(sx, lo + 2 * cs)), t2)  # fmt: skip
    if rows > 3:
        t3 = vfma(q8dot8(w0, xq, xo + 3 * kp2, nc, lo + 3 * cs),
                  vmul(s0, vload(sx, lo + 3 * cs)), t3)  # fmt: skip
    return t0, t1, t2, t3


@njit(inline="always")
def _tile(w, o0, c0, scale, xq, qo, nc, sx, so, pairs, odd, gsh, pf, rows):
    """One output row (weights at w's offset o0, scales at c0) against ``rows`` (1 to
    4) quantized rows of x, a tile laid out pair by pair (``rows`` rows of each pair
    together: xq from offset qo, nc / sx from so), so every load in the loop is one
    pointer plus a constant: each pair's codes are unpacked once for all the rows.
    Returns the 4 accumulators, one a row."""
    t0, t1, t2, t3 = vzero(), vzero(), vzero(), vzero()
    xstep, cstep = rows * PAIR, rows * LANES
    for p in range(pairs):
        wb = p * BLOCK
        prefetch(w, o0 + wb + pf)
        w0 = q4codes(w, o0 + wb)
        s0 = _scales2(scale, c0, (2 * p) >> gsh, (2 * p + 1) >> gsh, gsh)
        t0, t1, t2, t3 = _rows4(w0, s0, xq, qo + p * xstep, PAIR, nc, sx, so + p * cstep,
                                LANES, rows, t0, t1, t2, t3)  # fmt: skip
    if odd:  # K ends one block into the last pair
        p = pairs
        g0 = (2 * p) >> gsh
        w0 = q4codes1(w, o0 + p * BLOCK)
        s0 = vhalves2(scale, c0 + g0, c0 + g0)
        t0, t1, t2, t3 = _rows4(w0, s0, xq, qo + p * xstep, PAIR, nc, sx, so + p * cstep,
                                LANES, rows, t0, t1, t2, t3)  # fmt: skip
    return t0, t1, t2, t3


@njit(parallel=True, cache=True)
def gemv_q4_q8(x, w, scale, bias, y, xq, nc, sx, flags, act, a, b):
    """y[M, N] = act(q8(x)[M, K] @ dequant(w)[:, :K].T + bias): w the packed int4 weights
    [N, Kp/2] (uint8), scale their fp16 group scales [N, Kp/G] as uint16 (wtypes.py);
    q8(x) its rows quantized into xq [M, kp2] (int8), nc and sx [M, kp2 / 4] (int32,
    float32; 8 of each per pair used), kp2 = Kp rounded up to 64 (scratch; module doc).
    Tiles of 1 output row x up to 4 rows of x (the scratch holds each tile's rows pair
    by pair); bias and activation are a pass of their own."""
    m_, k_ = x.shape
    n_, half = w.shape
    gs = scale.shape[1]
    kp = half * 2
    group = kp // gs
    kp2 = xq.shape[1]
    cs = nc.shape[1]
    for m in range(m_):  # tiles of MROWS rows, pair by pair (_tile)
        t0_, r = m - m % MROWS, m % MROWS
        rt = min(MROWS, m_ - t0_)
        _quantize_row(x, m * k_, k_, xq, t0_ * kp2 + r * PAIR, rt * PAIR, nc,
                      t0_ * cs + r * LANES, rt * LANES, sx)  # fmt: skip
    pairs = kp // PAIR
    odd = 1 if kp % PAIR != 0 else 0
    gsh = 0  # block b's scale is group b >> gsh (group sizes are 32 * 2**gsh; a
    while BLOCK << gsh < group:  # division here cost two idivs a pair, a third of it)
        gsh += 1
    pf = max(ROWS, PREFETCH_BYTES // max(half, 1)) * half
    nb = (n_ + ROWS - 1) // ROWS
    for blk in prange(nb):
        # x's tile outside, the task's output rows inside: a tile's quantized rows (4 x
        # 1.2 KB at K = 576) stay in L1 while the rows pass; the other order streamed
        # every row of x past each output row (32 rows: 55 KB, past L1)
        for m0 in range(0, m_, MROWS):
            rows = min(MROWS, m_ - m0)
            for n in range(blk * ROWS, min(blk * ROWS + ROWS, n_)):
                qo, so = m0 * kp2, m0 * cs
                if rows == MROWS and gsh == 0:  # the usual tile: its row count and the
                    # groups of 32 constants, no branch left in its loop
                    t0, t1, t2, t3 = _tile(w, n * half, n * gs, scale, xq, qo, nc, sx, so,
                                           pairs, odd, 0, pf, MROWS)
                elif rows == MROWS:
                    t0, t1, t2, t3 = _tile(w, n * half, n * gs, scale, xq, qo, nc, sx, so,
                                           pairs, odd, gsh, pf, MROWS)
                elif rows == 1:  # one sequence's decode step
                    t0, t1, t2, t3 = _tile(w, n * half, n * gs, scale, xq, qo, nc, sx, so,
                                           pairs, odd, gsh, pf, 1)
                elif rows == 2:  # a constant row count each: with a variable one the
                    # serial build kept the row branches in the loop (2 rows, 1 thread,
                    # SmolLM2's linears: 39 ms a step against 6 for 1 row and 12 for 4)
                    t0, t1, t2, t3 = _tile(w, n * half, n * gs, scale, xq, qo, nc, sx, so,
                                           pairs, odd, gsh, pf, 2)
                else:
                    t0, t1, t2, t3 = _tile(w, n * half, n * gs, scale, xq, qo, nc, sx, so,
                                           pairs, odd, gsh, pf, 3)
                yo = m0 * n_ + n
                sstore(y, yo, vsum(t0))
                if rows > 1:
                    sstore(y, yo + n_, vsum(t1))
                if rows > 2:
                    sstore(y, yo + 2 * n_, vsum(t2))
                if rows > 3:
                    sstore(y, yo + 3 * n_, vsum(t3))
    if flags & HAS_BIAS or act != 0:  # no scale: the weights' are in the products
        for m in range(m_):
            linear_epilogue_row(y[m], bias, bias, flags & HAS_BIAS, act, a, b)
