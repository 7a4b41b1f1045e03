"""Int8 weights interleaved by 16 output rows against int8-quantized activations.

The int8 sibling of q4x16.py, for the int8 linears of a language model: an int8
bundle's projections (ggml's Q8_0 x Q8_0) and an int4 bundle's output projection,
whose table int4 bundles keep in int8. The weights of a linear node with ``xq`` and
``interleave = 16`` (packager/layout.py ``interleave_rows``; kernels/layout.py
``q8_interleave``) are stored per group of 16 rows and block of 32 weights as 512 bytes
``[d][row][4]``: one 64-byte load holds 4 weights of each of 16 rows, one row per
vector lane. The per-row float32 scales stay as they are (16 rows side by side already).

Activations are quantized exactly as for q4x16.py (blocks of 32, max|x| / 127, round
half to even, natural order), with nc[m, b] = -128 times the block's code sum.

Per block and row of x, the 16 rows' int32 sums come from 8 dot instructions, then
one convert and one multiply-add by the block's activation scale; the rows' weight
scales multiply once at the end. The integer sums are exact whatever makes them:

- AVX-512 VNNI (and AVX-VNNI on 256-bit halves): ``vpdpbusd`` multiplies unsigned by
  signed bytes, so the weights go in as w + 128 (one xor of the sign bit) against the
  signed activations, and the sums start from nc, which takes the 128 x sum(x) off;
- AVX2: ``vpmaddubsw`` of |x| with w carrying x's sign (``vpsignb``), then
  ``vpmaddwd`` per vector: |2 x 127 x 127| = 32258 fits int16, where w + 128 would
  saturate (2 x 255 x 127);
- aarch64 ``sdot``: signed by signed as they are; otherwise plain widening multiplies.

Every lane's float work is the same sequence on every CPU, so all builds give the same
bits, and a row of x gets the same bits whichever tile it is in.

SmolLM2-135M's output projection (49152 x 576), 8 rows, 2 threads on a 2-core Zen 4:
see docs/cpu-kernels.md "Int8 x int8: rows interleaved by 16".
"""

from __future__ import annotations

from llvmlite import ir
from numba import prange
from numba.extending import intrinsic

from ..flags import HAS_BIAS
from .jit import njit
from .kernels import linear_epilogue_row
from .q4x16 import (
    _CODES,
    _SUMS,
    BLOCK,
    LANES,
    MR,
    _quantize_row,
    dot_intrinsic,
    ifloat,
    isplat_ir,
    vfma,
    vmul,
    vsplat,
    vstore,
    vzero,
)
from .qdot import _consts, _features, _vec, dot_isa
from .simd import I32, Ops, _elem_ptr, prefetch

GROUP_BYTES = LANES * BLOCK  # one block of a group of rows: 512 bytes
CODE_OFFSET = 128  # what the VNNI paths add to each weight (the sign bit flipped)
# Each block's lines are prefetched this far ahead (about the next group of rows):
# 49152 x 576 from DRAM, 2 threads, Zen 4, in one process against no prefetch: 8 rows
# 1.18 -> 0.84 ms, 1 row 0.76-0.80 -> 0.77-0.86 (4096: 1.09 and 0.73-0.79; 2048: worse).
# 12 KB (q4x16.py's distance) against 8 KB, 8 rows, four copies of the weights in turn,
# numba JIT, same session: 1 thread 1.54-1.57 -> 1.42-1.49 ms, 2 threads 1.01 -> 0.97.
PREFETCH_BYTES = 12288

_V = Ops(LANES)
vload, sload = _V.vload, _V.sload

_I8 = ir.IntType(8)


def _vnni(context) -> bool:
    return dot_isa(_features(context)) in ("vnni512", "vnni256")


@intrinsic
def q8w(typingctx, w, wo):
    """The 64 weight bytes at w's flat offset wo, as the dot instructions take them: the
    sign bit flipped (w + 128, unsigned) for VNNI, as they are otherwise."""

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        raw = builder.load(builder.bitcast(p, _vec(_I8, 64).as_pointer()), align=1)
        if _vnni(context):
            return builder.xor(raw, _consts(_I8, [-128] * 64))
        return raw

    return _CODES(w, wo), codegen


@intrinsic
def q8start(typingctx, nc, co):
    """Where a block's integer sums start: nc[co] (-128 x the activation codes' sum) in
    every lane for VNNI, whose weights carry 128 more; zero for the others."""

    def codegen(context, builder, sig, args):
        if not _vnni(context):
            return ir.Constant(_vec(I32, LANES), [0] * LANES)
        return isplat_ir(context, builder, sig, args)

    return _SUMS(nc, co), codegen


dot8x4 = dot_intrinsic(True)  # int8 weights as ``q8w`` gives them


@njit(inline="always")
def _row(c0, c1, c2, c3, c4, c5, c6, c7, xq, xo, nc, sx, co, t):
    """One block of 16 output rows against one row of x: t + sums * activation scale."""
    i = dot8x4(q8start(nc, co), c0, c1, c2, c3, xq, xo)
    i = dot8x4(i, c4, c5, c6, c7, xq, xo + 16)
    return vfma(ifloat(i), vsplat(sload(sx, co)), t)


@njit(inline="always")
def _tile(w, wo, xq, qo, kp2, nc, sx, co, cs, nb, rows):
    """16 output rows (weights from w's offset wo) against ``rows`` (1 to 4) rows of x
    (xq from qo, nc / sx from co; row strides kp2 and cs)."""
    t0, t1, t2, t3 = vzero(), vzero(), vzero(), vzero()
    for b in range(nb):
        o = wo + b * GROUP_BYTES
        for line in range(0, GROUP_BYTES, 64):
            prefetch(w, o + PREFETCH_BYTES + line)
        c0, c1, c2, c3 = q8w(w, o), q8w(w, o + 64), q8w(w, o + 128), q8w(w, o + 192)
        c4, c5, c6, c7 = q8w(w, o + 256), q8w(w, o + 320), q8w(w, o + 384), q8w(w, o + 448)
        xo, c = qo + b * BLOCK, co + b
        t0 = _row(c0, c1, c2, c3, c4, c5, c6, c7, xq, xo, nc, sx, c, t0)
        if rows > 1:
            t1 = _row(c0, c1, c2, c3, c4, c5, c6, c7, xq, xo + kp2, nc, sx, c + cs, t1)
        if rows > 2:
            t2 = _row(c0, c1, c2, c3, c4, c5, c6, c7, xq, xo + 2 * kp2, nc, sx, c + 2 * cs, t2)
        if rows > 3:
            t3 = _row(c0, c1, c2, c3, c4, c5, c6, c7, xq, xo + 3 * kp2, nc, sx, c + 3 * cs, t3)
    return t0, t1, t2, t3


@njit(parallel=True, cache=True)
def gemm_q8x16_q8(x, w, scale, bias, y, xq, nc, sx, flags, act, a, b):
    """y[M, N] = act(q8(x)[M, K] @ (w * scale[:, None]).T + bias): w the int8 weights
    interleaved by 16 rows ([N, K] int8, N a multiple of 16, K of 32), scale their
    per-row float32 scales [N]; q8(x) its rows quantized into xq [M, kp2] (int8), nc
    and sx [M, kp2 / 4] (int32, float32; one of each a block used): the scratch of
    qdot.gemv_q4_q8. A parallel task takes one group of 16 rows against every tile of
    up to 4 rows of x; bias and activation are a pass of their own."""
    m_, k_ = x.shape
    n_ = w.shape[0]
    nb = w.shape[1] // BLOCK
    kp2 = xq.shape[1]
    cs = nc.shape[1]
    for m in range(m_):
        _quantize_row(x, m * k_, k_, xq, m * kp2, nb, nc, sx, m * cs, -CODE_OFFSET)
    for g in prange(n_ // LANES):
        wo = g * LANES * w.shape[1]
        s = vload(scale, g * LANES)
        for m0 in range(0, m_, MR):
            rows = min(MR, m_ - m0)
            qo, co = m0 * kp2, m0 * cs
            # a constant row count each (q4x16.py: a variable one keeps the branches)
            if rows == MR:
                t0, t1, t2, t3 = _tile(w, wo, xq, qo, kp2, nc, sx, co, cs, nb, MR)
            elif rows == 1:
                t0, t1, t2, t3 = _tile(w, wo, xq, qo, kp2, nc, sx, co, cs, nb, 1)
            elif rows == 2:
                t0, t1, t2, t3 = _tile(w, wo, xq, qo, kp2, nc, sx, co, cs, nb, 2)
            else:
                t0, t1, t2, t3 = _tile(w, wo, xq, qo, kp2, nc, sx, co, cs, nb, 3)
            yo = m0 * n_ + g * LANES
            vstore(y, yo, vmul(t0, s))
            if rows > 1:
                vstore(y, yo + n_, vmul(t1, s))
            if rows > 2:
                vstore(y, yo + 2 * n_, vmul(t2, s))
            if rows > 3:
                vstore(y, yo + 3 * n_, vmul(t3, s))
    if flags & HAS_BIAS or act != 0:  # no scale: the weights' are in the products
        for m in range(m_):
            linear_epilogue_row(y[m], bias, bias, flags & HAS_BIAS, act, a, b)
