"""Int4 weights interleaved by 16 output rows against int8-quantized activations.

The weights of a linear node with ``interleave = 16`` (packager/layout.py
``interleave_rows``; the layout is kernels/layout.py ``q4_interleave``) are stored so
that one 64-byte load holds 4 bytes of each of 16 output rows: per group of 16 rows
and block of 32 weights, 256 bytes ``[d][row][4]``, where a row's 4 bytes of run d
hold its weights 4d..4d+3 (low nibbles) and 16+4d..16+4d+3 (high nibbles); the fp16
group scales of the 16 rows lie side by side. Each vector lane then belongs to one
output row, so one ``vpdpbusd`` takes 64 products for 16 rows at once against 4
activation bytes broadcast, and a block's int32 sums for 16 rows turn into floats with
one convert and one multiply-add: a block costs 8 integer dot instructions and 3 float
ones a row of x, where the pair-wise GEMV (qdot.py, canonical weights) spends about 8
instructions a row per 64 products and sums its lanes per output row at the end.
Measured on SmolLM2-135M's int4 linears, 2 threads, 2-core Zen 4: see
docs/cpu-kernels.md "Int4 x int8: rows interleaved by 16".

Activations are quantized as qdot.py's (blocks of 32, scale max|x| / 127, round half to
even; the same values as the reference's ``quantize_activations``) but kept in natural
order: row m's block b at xq[m, 32b:32b+32], with nc[m, b] = -8 times the block's code
sum (the weight codes are q + 8; starting the integer sums there takes the 8 off
exactly) and sx[m, b] its scale.

The integer sums are exact whatever instruction makes them (``_dot4x4``: AVX-512 VNNI,
AVX-VNNI on 256-bit halves, AVX2 ``vpmaddubsw`` + ``vpmaddwd``, aarch64 ``sdot``, or
plain widening multiplies) and every lane's float work is the same sequence on every
CPU, so all builds give the same bits; a row of x gets the same bits whichever tile it
is in, so a sequence decodes the same alone or batched with others.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, models, register_model

from ..flags import HAS_BIAS
from ..layout import Q4_INTERLEAVE
from .abi import XQ_BLOCK
from .jit import njit
from .kernels import linear_epilogue_row
from .qdot import _call, _consts, _features, _half_bits_to_f32_soft, _join, _part, _vec, dot_isa
from .simd import F32, I32, F32Vec, Ops, _elem_ptr, prefetch

LANES = Q4_INTERLEAVE  # output rows a group holds: one float32 lane each
MR = 4  # rows of x a tile takes (q8x16.py's; here tile_rows may take 8): each block's
# codes are unpacked once for them
BLOCK = XQ_BLOCK
GROUP_BYTES = LANES * BLOCK // 2  # one block of a group of rows: 256 bytes
# Bytes ahead of the block in use whose lines each block asks for (four 64-byte lines a
# block, as it reads). The hardware prefetcher alone left an 8-row product on weights
# from DRAM at 123 us against 89 in cache (3072 x 576, 1 thread, Zen 4); 4 KB ahead
# gave 103, 12 KB 101 (and one row 46 -> 41 us): gemv.py's distance.
PREFETCH_BYTES = 12288

_V = Ops(LANES)
vzero, vfma, vmul, vsplat = _V.vzero, _V.vfma, _V.vmul, _V.vsplat
vstore, sload, sstore = _V.vstore, _V.sload, _V.sstore

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)


class _IVec(types.Type):
    """A vector of ``n`` ``bits``-bit integers held in registers."""

    def __init__(self, bits: int, n: int):
        self.bits, self.n = bits, n
        super().__init__(name=f"i{bits}x{n}")


@register_model(_IVec)
class _IVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _vec(ir.IntType(fe_type.bits), fe_type.n))


_CODES = _IVec(8, 4 * LANES)  # 4 weight codes (0..15) of each of the 16 rows
_SUMS = _IVec(32, LANES)  # one int32 sum a row


def _nibbles(high: bool):
    @intrinsic
    def codes(typingctx, w, wo):
        """The 64 low (or high) nibbles of the bytes at w's flat offset wo."""

        def codegen(context, builder, sig, args):
            p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            raw = builder.load(builder.bitcast(p, _vec(_I8, 64).as_pointer()), align=1)
            if high:
                return builder.lshr(raw, _consts(_I8, [4] * 64))
            return builder.and_(raw, _consts(_I8, [15] * 64))

        return _CODES(w, wo), codegen

    return codes


q4lo, q4hi = _nibbles(False), _nibbles(True)


def isplat_ir(context, builder, sig, args):
    """arr[idx] (int32, args of an (arr, idx) intrinsic) in every lane: the IR."""
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
    v = builder.insert_element(ir.Constant(_vec(I32, LANES), ir.Undefined),
                               builder.load(p), ir.Constant(I32, 0))  # fmt: skip
    return builder.shuffle_vector(v, ir.Constant(_vec(I32, LANES), ir.Undefined),
                                  _consts(I32, [0] * LANES))  # fmt: skip


@intrinsic
def isplat(typingctx, arr, idx):
    """arr[idx] (int32) in every lane."""
    return _SUMS(arr, idx), isplat_ir


@intrinsic
def ifloat(typingctx, v):
    """The int32 lanes as float32 (exact: |sum| < 2**24)."""

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _vec(F32, LANES))

    return F32Vec(LANES)(v), codegen


def tile_rows_for(features: frozenset[str] | set[str]) -> int:
    """Rows of x the interleaved int4 kernel's tiles take on a CPU with these features: 8
    where the dot is 512-bit VNNI, else MR. A block's unpacking (4 loads, 12 mask and
    shift instructions, the scales' convert) is shared by the tile's rows, each of which
    costs 8 vpdpbusd and 4 other instructions; 8 rows take 14 % fewer instructions a row
    than 4 and fit Zen 4's and Ice Lake's 32 zmm registers (8 accumulators, 8 code
    vectors). The 256- and 128-bit families hold a 16-lane vector in 2 or 4 registers,
    where 8 rows would spill."""
    return 8 if dot_isa(features) == "vnni512" else MR


@intrinsic
def tile_rows(typingctx):
    """``tile_rows_for`` the features this kernel is compiled for (a constant)."""

    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(64), tile_rows_for(_features(context)))

    return types.int64(), codegen


@intrinsic
def halves(typingctx, h, ho):
    """The 16 fp16 scales (uint16 bits) at h's flat offset ho as float32: one vcvtph2ps
    (F16C, AVX-512) or fcvtl (aarch64), else qdot's integer conversion (SSE-only x86,
    where LLVM's fpext calls a helper numba does not link)."""

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        bits = builder.load(builder.bitcast(p, _vec(_I16, LANES).as_pointer()), align=2)
        feats = _features(context)
        if "f16c" in feats or "avx512f" in feats or not any(f.startswith("sse") for f in feats):
            return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), LANES)),
                                 _vec(F32, LANES))  # fmt: skip
        v = ir.Constant(_vec(F32, LANES), ir.Undefined)
        for i in range(LANES):
            e = builder.extract_element(bits, ir.Constant(I32, i))
            v = builder.insert_element(v, _half_bits_to_f32_soft(builder, e), ir.Constant(I32, i))
        return v

    return F32Vec(LANES)(h, ho), codegen


def _bcast4(builder, xv, j):
    """Bytes 4j..4j+3 of the 16-byte xv repeated into 64 bytes."""
    d = builder.bitcast(xv, _vec(I32, 4))
    rep = builder.shuffle_vector(d, ir.Constant(_vec(I32, 4), ir.Undefined),
                                 _consts(I32, [j] * LANES))  # fmt: skip
    return builder.bitcast(rep, _vec(_I8, 64))


def _dot4x4(builder, isa: str, acc, codes, xs, signed: bool):
    """acc[l] + sum over the 4 code vectors c of sum_{i<4} c[4l+i] * x_c[4l+i], exact: xs
    the signed activation bytes broadcast (``_bcast4``); codes unsigned (int4's 0..15),
    or ``signed`` int8 weights (q8x16.py), which VNNI takes as w + 128 (the caller's
    flip and start) and AVX2 as |x| against w with x's sign."""
    if isa == "vnni512":
        v16 = _vec(I32, 16)
        for c, x in zip(codes, xs):
            acc = _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                        [acc, builder.bitcast(c, v16), builder.bitcast(x, v16)])  # fmt: skip
        return acc
    if isa == "vnni256":  # two halves of 8 rows, each a chain of 256-bit vpdpbusd
        v8 = _vec(I32, 8)
        out = []
        for h in range(2):
            a = _part(builder, acc, 8 * h, 8)
            for c, x in zip(codes, xs):
                a = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                          [a, builder.bitcast(_part(builder, c, 32 * h, 32), v8),
                           builder.bitcast(_part(builder, x, 32 * h, 32), v8)])  # fmt: skip
            out.append(a)
        return _join(builder, out)
    if isa == "avx2":
        out = []
        ones = _consts(_I16, [1] * 16)
        v32 = _vec(_I8, 32)
        for h in range(2):
            a, s = _part(builder, acc, 8 * h, 8), None
            for c, x in zip(codes, xs):
                ch, xh = _part(builder, c, 32 * h, 32), _part(builder, x, 32 * h, 32)
                if signed:  # |x| by w with x's sign, widened per vector: |2 x 127 x 127|
                    # fits int16, w + 128 would saturate (2 x 255 x 127)
                    ax = _call(builder, "llvm.abs.v32i8", v32, [xh, ir.Constant(ir.IntType(1), 0)])
                    sw = _call(builder, "llvm.x86.avx2.psign.b", v32, [ch, xh])
                    p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [ax, sw])
                    a = builder.add(a, _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8),
                                             [p, ones]))  # fmt: skip
                    continue
                # codes: i16 pair sums of the 4 vectors added before one widening
                # multiply-add: |4 * 2 * 15 * 127| = 15240 < 32767, no saturation anywhere
                p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [ch, xh])
                s = p if s is None else builder.add(s, p)
            if s is not None:
                a = builder.add(a, _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8),
                                         [s, ones]))  # fmt: skip
            out.append(a)
        return _join(builder, out)
    if isa == "sdot":  # four quarters of 4 rows (codes 0..15 are the same signed)
        out = []
        for q in range(4):
            a = _part(builder, acc, 4 * q, 4)
            for c, x in zip(codes, xs):
                a = _call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(I32, 4),
                          [a, _part(builder, c, 16 * q, 16), _part(builder, x, 16 * q, 16)])
            out.append(a)
        return _join(builder, out)
    wide = _vec(I32, 64)
    widen = builder.sext if signed else builder.zext
    for c, x in zip(codes, xs):
        p = builder.mul(widen(c, wide), builder.sext(x, wide))
        for i in range(4):
            lanes = _consts(I32, [4 * lane + i for lane in range(LANES)])
            acc = builder.add(acc, builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined),
                                                          lanes))  # fmt: skip
    return acc


def dot_intrinsic(signed: bool):
    """The intrinsic (acc, c0, c1, c2, c3, xq, xo): acc plus, per row lane, the products
    of code vectors c0..c3 with the 16 activation bytes at xq's flat offset xo (c_j
    against bytes 4j..4j+3); ``signed``: int8 weights (``_dot4x4``)."""

    @intrinsic
    def dot(typingctx, acc, c0, c1, c2, c3, xq, xo):
        def codegen(context, builder, sig, args):
            px = _elem_ptr(context, builder, sig.args[5], args[5], args[6], sig.args[6])
            xv = builder.load(builder.bitcast(px, _vec(_I8, 16).as_pointer()), align=1)
            xs = [_bcast4(builder, xv, j) for j in range(4)]
            isa = dot_isa(_features(context))
            return _dot4x4(builder, isa, args[0], args[1:5], xs, signed)

        return _SUMS(acc, c0, c1, c2, c3, xq, xo), codegen

    return dot


dot4x4 = dot_intrinsic(False)  # int4 codes (0..15)


@njit(inline="always")
def _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo, nc, sx, co, t):
    """One block of 16 output rows against one row of x: its int32 sums (from -8 times
    the block's code sum), then t + sums * (weight scales * activation scale)."""
    i = dot4x4(isplat(nc, co), lo0, lo1, lo2, lo3, xq, xo)
    i = dot4x4(i, hi0, hi1, hi2, hi3, xq, xo + 16)
    return vfma(ifloat(i), vmul(s, vsplat(sload(sx, co))), t)


@njit(inline="always")
def _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb, gsh, rows):
    """16 output rows (weights from w's offset wo, scales from so) against ``rows`` (1
    to 8, a constant) rows of x (xq from qo, nc / sx from co; row strides kp2 and cs)."""
    t0, t1, t2, t3, t4, t5, t6, t7 = (vzero(), vzero(), vzero(), vzero(), vzero(), vzero(),
                                      vzero(), vzero())  # fmt: skip
    for b in range(nb):
        o = wo + b * GROUP_BYTES
        for q in range(4):  # past the weights: dropped
            prefetch(w, o + PREFETCH_BYTES + 64 * q)
        lo0, lo1, lo2, lo3 = q4lo(w, o), q4lo(w, o + 64), q4lo(w, o + 128), q4lo(w, o + 192)
        hi0, hi1, hi2, hi3 = q4hi(w, o), q4hi(w, o + 64), q4hi(w, o + 128), q4hi(w, o + 192)
        s = halves(scale, so + (b >> gsh) * LANES)
        xo, c = qo + b * BLOCK, co + b
        t0 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo, nc, sx, c, t0)
        if rows > 1:
            t1 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + kp2, nc, sx, c + cs,
                      t1)  # fmt: skip
        if rows > 2:
            t2 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 2 * kp2, nc, sx,
                      c + 2 * cs, t2)  # fmt: skip
        if rows > 3:
            t3 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 3 * kp2, nc, sx,
                      c + 3 * cs, t3)  # fmt: skip
        if rows > 4:
            t4 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 4 * kp2, nc, sx,
                      c + 4 * cs, t4)  # fmt: skip
            t5 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 5 * kp2, nc, sx,
                      c + 5 * cs, t5)  # fmt: skip
            t6 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 6 * kp2, nc, sx,
                      c + 6 * cs, t6)  # fmt: skip
            t7 = _row(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, s, xq, xo + 7 * kp2, nc, sx,
                      c + 7 * cs, t7)  # fmt: skip
    return t0, t1, t2, t3, t4, t5, t6, t7


@njit(inline="always")
def _store(y, yo, n_, rows, t):
    """The tile's ``rows`` rows of 16 outputs into y from its flat offset yo (row stride
    n_)."""
    vstore(y, yo, t[0])
    if rows > 1:
        vstore(y, yo + n_, t[1])
    if rows > 2:
        vstore(y, yo + 2 * n_, t[2])
    if rows > 3:
        vstore(y, yo + 3 * n_, t[3])
    if rows > 4:
        vstore(y, yo + 4 * n_, t[4])
        vstore(y, yo + 5 * n_, t[5])
        vstore(y, yo + 6 * n_, t[6])
        vstore(y, yo + 7 * n_, t[7])


@njit(inline="always")
def _quantize_row(x, xo, k_, xq, qo, nb, nc, sx, co, off):
    """x's row at flat offset xo (k_ values) into nb int8 blocks of 32 at xq's offset qo
    (zeros past k_), each block's ``off`` * code sum at nc[co + b] (off = minus the
    weight codes' offset) and scale at sx[co + b]."""
    for b in range(nb):
        k0 = b * BLOCK
        kn = min(BLOCK, k_ - k0)
        amax = np.float32(0)
        for j in range(kn):
            amax = max(amax, abs(sload(x, xo + k0 + j)))
        d = amax / np.float32(127)
        total = np.int32(0)
        for j in range(BLOCK):
            v = sload(x, xo + k0 + j) if j < kn else np.float32(0)
            q = np.rint(v / d) if d > 0 else np.float32(0)
            q = min(max(q, np.float32(-127)), np.float32(127))
            sstore(xq, qo + k0 + j, np.int8(q))
            total += np.int32(q)
        sstore(nc, co + b, np.int32(off) * total)
        sstore(sx, co + b, d)


@njit(parallel=True, cache=True)
def gemm_q4x16_q8(x, w, scale, bias, y, xq, nc, sx, flags, act, a, b):
    """y[M, N] = act(q8(x)[M, K] @ dequant(w)[:, :K].T + bias): w the int4 weights
    interleaved by 16 rows ([N, Kp/2] uint8, N a multiple of 16), scale their fp16
    group scales likewise ([N, Kp/G] as uint16); q8(x) its rows quantized into xq
    [M, kp2] (int8), nc and sx [M, kp2 / 4] (int32, float32; one of each a block
    used): the scratch of qdot.gemv_q4_q8. A parallel task takes one group of 16 rows
    against every tile of x's rows (``tile_rows``: 8 or 4 rows, then the rest); bias and
    activation are a pass of their own."""
    m_, k_ = x.shape
    n_, half = w.shape
    gs = scale.shape[1]
    kp = half * 2
    nb = kp // BLOCK
    kp2 = xq.shape[1]
    cs = nc.shape[1]
    for m in range(m_):
        _quantize_row(x, m * k_, k_, xq, m * kp2, nb, nc, sx, m * cs, -8)
    gsh = 0  # block b's scale is group b >> gsh (group sizes are 32 * 2**gsh)
    while BLOCK << gsh < kp // gs:
        gsh += 1
    big = tile_rows()  # 8 or 4, a constant of the build
    for g in prange(n_ // LANES):
        wo, so = g * LANES * half, g * LANES * gs
        m0 = 0
        while m0 < m_:
            left = m_ - m0
            qo, co, yo = m0 * kp2, m0 * cs, m0 * n_ + g * LANES
            # a constant row count each (tiles of 8 where the build takes them, then 4,
            # then the 1 to 3 left): a variable one keeps the row branches in the loop
            # (qdot.py measured 39 ms a step against 6)
            if big == 8 and left >= 8:
                _store(y, yo, n_, 8, _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb,
                                           gsh, 8))  # fmt: skip
                m0 += 8
            elif left >= 4:
                _store(y, yo, n_, 4, _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb,
                                           gsh, 4))  # fmt: skip
                m0 += 4
            elif left == 3:
                _store(y, yo, n_, 3, _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb,
                                           gsh, 3))  # fmt: skip
                m0 += 3
            elif left == 2:
                _store(y, yo, n_, 2, _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb,
                                           gsh, 2))  # fmt: skip
                m0 += 2
            else:
                _store(y, yo, n_, 1, _tile(w, wo, scale, so, xq, qo, kp2, nc, sx, co, cs, nb,
                                           gsh, 1))  # fmt: skip
                m0 += 1
    if flags & HAS_BIAS or act != 0:  # no scale: the weights' are in the products
        for m in range(m_):
            linear_epilogue_row(y[m], bias, bias, flags & HAS_BIAS, act, a, b)
