"""The matrix-vector product on explicit vectors (``linear`` with int8, fp16 or bf16
weights, read in place).

A decoder LLM at batch 1 is a chain of GEMVs bound by the weights' bytes. The plain
loop this replaces (kernels.linear_q) kept one float chain per row, which
does not vectorise without reassociation: SmolLM2-135M's int8 decode spent 89 of its
91 ms a token there, 1.5 GB/s of weights. Here each row's sum runs in 16 float32
lanes (simd.Ops(16) on every CPU: AVX-512 one zmm, AVX2 two ymm, NEON four q
registers), so the order of every addition, and hence every bit, is the same on all
CPUs and in the JIT and AOT builds; the lanes are reduced once, at the end.

Weights stay as stored and are widened exactly in registers (simd vloadw: int8 one
vpmovsxbd + vcvtdq2ps, fp16 one vcvtph2ps, bf16 a shift; bf16 arrives viewed as int16,
fp16 as uint16, which is how the kernel tells them apart). Four output rows share each
load of x, and each row keeps two accumulators (even and odd vectors of a 32-weight
step), so eight independent FMA chains hide the FMA latency. A row's lanes are added
pairwise (vsum_tree: four dependent adds, not fifteen), and the scale/bias/activation
epilogue is a separate pass over y: on 576-wide rows the block's own setup, reduction
and epilogue branches had cost as much as its dot products, and the serial build (what
1-thread runs and AOT executables use) had run 1.5x slower than the parallel one
because of them.

With 4 or more rows of x (a batched decode step), tiles of 1 weight row x 4 rows of x
widen each vector of weights once for the four (``_dot1x4``): SmolLM2's 49152 x 576
int8 output projection, 2 threads on a Zen 2, 8 rows 6.9 -> 3.4 ms, 4 rows 3.5 -> 1.9.
Rows left over (all of them below 4) take the 4-output-row loop above.

1 thread, this box (AVX-512 EPYC), medians: 21 GB/s of weights on 1536 x 576, 29 on
576 x 1536 and 21 on the 49152 x 576 output projection from DRAM (the AVX2 build the
same), where the loop it replaces ran at 1.5; SmolLM2-135M int8 decode went from 11
to 108 tokens/s.
"""

from __future__ import annotations

from numba import prange

from .jit import njit
from .kernels import linear_epilogue_row
from .simd import Ops, prefetch

LANES = 16
ROWS = 4  # output rows sharing each load of x (fewer than XROWS rows of x)
XROWS = 4  # rows of x sharing each widened vector of weights (tiles of 1 x 4)
# How far ahead each row is prefetched, in bytes of weights. The hardware prefetcher
# alone held SmolLM2's 49152 x 576 output projection (28 MB, from DRAM) at 6.7 GB/s on
# one thread; 4 to 32 rows ahead (2 to 18 KB) gave 11.7, 20.3, 20.9 and 21.6 GB/s.
PREFETCH_BYTES = 12288
_V = Ops(LANES)
vload, vload_n, vloadw, vloadw_n = _V.vload, _V.vload_n, _V.vloadw, _V.vloadw_n
sload, sstore = _V.sload, _V.sstore
vfma, vadd, vsum, vzero = _V.vfma, _V.vadd, _V.vsum_tree, _V.vzero


@njit(inline="always")
def _dot4(x, xo, w, o0, o1, o2, o3, k_, pf):
    """The dot products of x's row at flat offset xo with the int8 rows of w starting
    at flat offsets o0..o3, each over k_ weights; each step also prefetches the lines
    pf bytes further on in every row (a hint: past w's end it is dropped)."""
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    b0, b1, b2, b3 = vzero(), vzero(), vzero(), vzero()
    kv = k_ - k_ % 32
    for k in range(0, kv, 32):
        xa = vload(x, xo + k)
        xb = vload(x, xo + k + 16)
        prefetch(w, o0 + pf + k)
        prefetch(w, o1 + pf + k)
        prefetch(w, o2 + pf + k)
        prefetch(w, o3 + pf + k)
        a0 = vfma(vloadw(w, o0 + k), xa, a0)
        b0 = vfma(vloadw(w, o0 + k + 16), xb, b0)
        a1 = vfma(vloadw(w, o1 + k), xa, a1)
        b1 = vfma(vloadw(w, o1 + k + 16), xb, b1)
        a2 = vfma(vloadw(w, o2 + k), xa, a2)
        b2 = vfma(vloadw(w, o2 + k + 16), xb, b2)
        a3 = vfma(vloadw(w, o3 + k), xa, a3)
        b3 = vfma(vloadw(w, o3 + k + 16), xb, b3)
    for k in range(kv, k_, 16):  # the last K % 32 weights: masked, nothing past K read
        n = k_ - k
        xa = vload_n(x, xo + k, n)
        a0 = vfma(vloadw_n(w, o0 + k, n), xa, a0)
        a1 = vfma(vloadw_n(w, o1 + k, n), xa, a1)
        a2 = vfma(vloadw_n(w, o2 + k, n), xa, a2)
        a3 = vfma(vloadw_n(w, o3 + k, n), xa, a3)
    return vsum(vadd(a0, b0)), vsum(vadd(a1, b1)), vsum(vadd(a2, b2)), vsum(vadd(a3, b3))


@njit(inline="always")
def _dot1x4(x, xo, xs, w, o, k_, pf):
    """The dot products of w's row at flat offset o with 4 rows of x (flat offsets xo,
    xo + xs, ...), each vector of weights widened once for the four."""
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    kv = k_ - k_ % LANES
    for k in range(0, kv, LANES):
        if k % 64 == 0:
            prefetch(w, o + pf + k)
        wv = vloadw(w, o + k)
        a0 = vfma(wv, vload(x, xo + k), a0)
        a1 = vfma(wv, vload(x, xo + xs + k), a1)
        a2 = vfma(wv, vload(x, xo + 2 * xs + k), a2)
        a3 = vfma(wv, vload(x, xo + 3 * xs + k), a3)
    if kv < k_:  # the last K % 16 weights: masked, nothing past K read
        n = k_ - kv
        wv = vloadw_n(w, o + kv, n)
        a0 = vfma(wv, vload_n(x, xo + kv, n), a0)
        a1 = vfma(wv, vload_n(x, xo + xs + kv, n), a1)
        a2 = vfma(wv, vload_n(x, xo + 2 * xs + kv, n), a2)
        a3 = vfma(wv, vload_n(x, xo + 3 * xs + kv, n), a3)
    return vsum(a0), vsum(a1), vsum(a2), vsum(a3)


@njit(parallel=True, cache=True)
def gemv(x, w, bias, scale, y, flags, act, a, b):
    """y[M, N] = act(x[M, K] @ w[N, K].T * scale + bias) reading int8 (int8), fp16
    (uint16 bits) or bf16 (int16 bits) weights in place (x, w and y C-contiguous). At
    M = 1 every weight is read once; for M > 1 a block's four weight rows stay in L1
    while each row of x passes them."""
    m_, k_ = x.shape
    n_ = w.shape[0]
    nb = (n_ + ROWS - 1) // ROWS
    pf = max(ROWS, PREFETCH_BYTES // max(k_, 1)) * k_  # a whole number of rows ahead
    for blk in prange(nb):
        n0 = blk * ROWS
        # rows past N repeat the last one: loads stay inside w, no branch in the loop
        o0 = n0 * k_
        o1 = min(n0 + 1, n_ - 1) * k_
        o2 = min(n0 + 2, n_ - 1) * k_
        o3 = min(n0 + 3, n_ - 1) * k_
        last = min(ROWS, n_ - n0)
        mt = m_ - m_ % XROWS
        for m0 in range(0, mt, XROWS):  # tiles of 4 rows of x: one weight row at a time
            for j in range(last):
                s0, s1, s2, s3 = _dot1x4(x, m0 * k_, k_, w, (n0 + j) * k_, k_, pf)
                yo = m0 * n_ + n0 + j
                sstore(y, yo, s0)
                sstore(y, yo + n_, s1)
                sstore(y, yo + 2 * n_, s2)
                sstore(y, yo + 3 * n_, s3)
        for m in range(mt, m_):  # the rows left (all of them below 4 rows)
            s0, s1, s2, s3 = _dot4(x, m * k_, w, o0, o1, o2, o3, k_, pf)
            yo = m * n_ + n0
            sstore(y, yo, s0)
            if last == ROWS:
                sstore(y, yo + 1, s1)
                sstore(y, yo + 2, s2)
                sstore(y, yo + 3, s3)
            else:
                if last > 1:
                    sstore(y, yo + 1, s1)
                if last > 2:
                    sstore(y, yo + 2, s2)
    # the epilogue as its own pass over y: in the block loop its branches (flags, the
    # activation) cost as much as the dot products on 576-wide rows
    if flags != 0 or act != 0:
        for m in range(m_):
            linear_epilogue_row(y[m], bias, scale, flags, act, a, b)
