"""CPU kernels of the decoder-LLM ops (references: kernels/ref/llm.py).

Plain numba loops in a fixed order (no fastmath), so the JIT and AOT builds and every
CPU give the same bits. Norm rows sum in 8-lane float32 vectors, in a fixed order
(``norm_rows``). The attention runs on 8 fixed lanes too (``simd.Ops(8)``: float32
scores and sums, the same on every CPU; how it spends its time is in
docs/cpu-kernels.md). fp16 KV caches are held as their uint16 bits (numba has no CPU
float16): keys and values are rounded to half on the way in (round to nearest even, as
NumPy's cast) and widened exactly on the way out.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .. import portable
from ..activations import EXP_LN2_HI, EXP_LN2_LO, EXP_LO, EXP_LOG2E, EXP_TAYLOR
from ..ops import GATE_ACTS
from .jit import njit
from .kernels import exp_f32, half_to_f32, tanh_f32
from .simd import Ops, prefetch

_V8 = Ops(8)  # eight lanes on every CPU (AVX-512 uses ymm, NEON two q registers)
vload, vloadh, vstore, vfma, vsum = _V8.vload, _V8.vloadh, _V8.vstore, _V8.vfma, _V8.vsum
vstoreh = _V8.vstoreh
vzero, vsplat, vadd, vsub = _V8.vzero, _V8.vsplat, _V8.vadd, _V8.vsub
vmul, vmax = _V8.vmul, _V8.vmax
vrint, vpow2i, vkeep_n, vsum_tree = _V8.vrint, _V8.vpow2i, _V8.vkeep_n, _V8.vsum_tree
vload_n, vstore_n = _V8.vload_n, _V8.vstore_n

# exp on vectors (attention's softmax), as kernels/activations.py EXP_* describe. The
# scalar libm exp in float64 had been most of a decode step's attention at depth 2048.
_LOG2E, _LN2_HI, _LN2_LO, _EXP_C = EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO, EXP_TAYLOR


@njit(inline="always")
def vexp(x):
    x = vmax(x, vsplat(np.float32(EXP_LO)))
    n = vrint(vmul(x, vsplat(np.float32(_LOG2E))))
    r = vfma(n, vsplat(np.float32(-_LN2_HI)), x)
    r = vfma(n, vsplat(np.float32(-_LN2_LO)), r)
    p = vsplat(np.float32(_EXP_C[0]))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[1])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[2])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[3])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[4])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[5])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[6])))
    p = vfma(p, r, vsplat(np.float32(_EXP_C[7])))
    return vmul(p, vpow2i(n))

# kernels/portable.py, compiled for this backend
f32_bits_to_half = njit(inline="always")(portable.f32_bits_to_half)


@njit(inline="always")
def _row_sum(xf, o, n):
    """x[o .. o+n-1] summed in four vectors of 8 float32 partial sums, then their lanes
    pairwise: the same order on every CPU."""
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    i = 0
    while i + 32 <= n:
        a0 = vadd(a0, vload(xf, o + i))
        a1 = vadd(a1, vload(xf, o + i + 8))
        a2 = vadd(a2, vload(xf, o + i + 16))
        a3 = vadd(a3, vload(xf, o + i + 24))
        i += 32
    while i < n:  # zeros past the end
        a0 = vadd(a0, vload_n(xf, o + i, n - i))
        i += 8
    return vsum_tree(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(inline="always")
def _row_sq_dev(xf, o, n, mean):
    """sum of (x[o + i] - mean)² over i < n, as _row_sum."""
    m = vsplat(mean)
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    i = 0
    while i + 32 <= n:
        d0, d1 = vsub(vload(xf, o + i), m), vsub(vload(xf, o + i + 8), m)
        d2, d3 = vsub(vload(xf, o + i + 16), m), vsub(vload(xf, o + i + 24), m)
        a0, a1, a2, a3 = vfma(d0, d0, a0), vfma(d1, d1, a1), vfma(d2, d2, a2), vfma(d3, d3, a3)
        i += 32
    while i < n:
        d = vkeep_n(vsub(vload_n(xf, o + i, n - i), m), n - i)
        a0 = vfma(d, d, a0)
        i += 8
    return vsum_tree(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(cache=True)
def norm_rows(x, w, b, y, eps, layer, has_b, group):
    """y[r] = (x[r] - mean) / sqrt(mean((x[r] - mean)²) + eps) * w (+ b) over each run of
    ``group`` columns of the first len(w) (as portable.norm_row); mean = 0 for RMSNorm
    (``layer`` 0). x, y [R, D] (y may be x). In vectors of 8 with float32 partial sums
    (portable.norm_row's float64 scalar chains took 4.7 us for a ViT's 17 x 64 rows;
    these 1.0), the mean and the scale in float64."""
    d = x.shape[1]
    n = w.shape[0]
    xf, yf = x.reshape(x.size), y.reshape(y.size)
    for r in range(x.shape[0]):
        o = r * d
        for c0 in range(0, n, group):
            mean = np.float32(0)
            if layer:
                mean = np.float32(np.float64(_row_sum(xf, o + c0, group)) / group)
            var = np.float64(_row_sq_dev(xf, o + c0, group, mean)) / group
            inv = vsplat(np.float32(1.0 / np.sqrt(var + eps)))
            m = vsplat(mean)
            for i in range(c0, c0 + group, 8):
                left = c0 + group - i
                t = vmul(vmul(vsub(vload_n(xf, o + i, left), m), inv), vload_n(w, i, left))
                if has_b:
                    t = vadd(t, vload_n(b, i, left))
                vstore_n(yf, o + i, t, left)
        for i in range(n, d):
            y[r, i] = x[r, i]


@njit(cache=True)
def rope_rows(x, pos, cos, sin, y, heads, hd):
    """Rotate-half RoPE of the first ``heads`` heads (``hd`` wide) of each row x[T, W]
    into y (which may be x); columns past them are copied."""
    half = cos.shape[1]
    for t in range(x.shape[0]):
        p = pos[t]
        if p < 0 or p >= cos.shape[0]:
            raise IndexError("rope: a position outside the RoPE tables (past the context)")
        for h in range(heads):
            o = h * hd
            for i in range(half):
                c = np.float64(cos[p, i])
                s = np.float64(sin[p, i])
                x1 = np.float64(x[t, o + i])
                x2 = np.float64(x[t, o + half + i])
                y[t, o + i] = x1 * c - x2 * s
                y[t, o + half + i] = x2 * c + x1 * s
            for i in range(2 * half, hd):
                y[t, o + i] = x[t, o + i]
        for i in range(heads * hd, x.shape[1]):
            y[t, i] = x[t, i]


GATE_CODES = {a: i for i, a in enumerate(GATE_ACTS)}  # what glu_rows' ``act`` means


@njit(cache=True)
def glu_rows(x, y, act):
    """y[r, i] = act(x[r, i]) * x[r, F + i], x [R, 2F], y [R, F]. In float32 with the
    libm-free exp and tanh, so the loops vectorise: the float64 gate called libm's exp
    per element, 8 ns each (SmolLM2's 32-token prompt chunk spent 12 ms in it, Zen 2)."""
    f = y.shape[1]
    for r in range(x.shape[0]):
        if act == 0:  # silu
            for i in range(f):
                g = x[r, i]
                y[r, i] = g / (np.float32(1) + exp_f32(-g)) * x[r, f + i]
        else:  # gelu_tanh
            for i in range(f):
                g = x[r, i]
                u = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
                t = tanh_f32(u)
                y[r, i] = np.float32(0.5) * g * (np.float32(1) + t) * x[r, f + i]


@njit(cache=True)
def embed_rows(ids, w, scale, y, mul, has_scale, x16):
    """y[t] = w[ids[t]] (* scale[ids[t]]) * mul, float32 or int8 tables; ``x16``: the
    int8 table interleaved by 16 rows (kernels/layout.py q8_interleave: row r's weights
    4d..4d+3 of block b at ((r // 16 * blocks + b) * 8 + d) * 64 + r % 16 * 4)."""
    d_ = w.shape[1]
    flat = w.reshape(-1)
    for t in range(ids.shape[0]):
        r = ids[t]
        if r < 0 or r >= w.shape[0]:
            raise IndexError("embed: a token id outside the embedding table")
        s = np.float64(scale[r]) if has_scale else 1.0
        if x16:
            base = r // 16 * 16 * d_ + r % 16 * 4
            for i in range(d_):
                o = base + (i >> 2) * 64 + (i & 3)  # block b, run d: i >> 2 = 8b + d
                y[t, i] = np.float64(np.float32(np.float32(flat[o]) * np.float32(s))) * mul
        else:
            for i in range(d_):
                y[t, i] = np.float64(np.float32(np.float32(w[r, i]) * np.float32(s))) * mul




@njit(cache=True)
def embed_rows_half(ids, bits, y, yu, mul, bf16):
    """y[t] = w[ids[t]] * mul for a table of fp16 or bfloat16 bits (uint16): a bfloat16
    is the top half of a float32 word, written through y's bits (yu) and read back."""
    for t in range(ids.shape[0]):
        r = ids[t]
        if r < 0 or r >= bits.shape[0]:
            raise IndexError("embed: a token id outside the embedding table")
        for i in range(bits.shape[1]):
            if bf16:
                yu[t, i] = np.uint32(bits[r, i]) << np.uint32(16)
                v = y[t, i]
            else:
                v = half_to_f32(bits[r, i])
            y[t, i] = np.float64(v) * mul


@njit(cache=True)
def halves_from_f32(bits, out):
    """float32 values (their uint32 bits) -> halves (uint16 bits), flat arrays."""
    for i in range(bits.size):
        out[i] = f32_bits_to_half(bits[i])


@njit(inline="always")
def _cached(c, s, p, kh, i, half):
    return half_to_f32(c[s, p, kh, i]) if half else np.float32(c[s, p, kh, i])


@njit(inline="always")
def _kv8(c, off, half):
    """Eight cached values from flat offset ``off``, as float32 (halves widened)."""
    return vloadh(c, off) if half else vload(c, off)


@njit(inline="always")
def _score(qkv, t, h, kc, s, j, kh, hd, half):
    """q (row t, head h) . k (slot s, position j, kv head kh): eight partial sums of
    fixed lanes when hd is a multiple of 8 (the same bits on every CPU), else a chain."""
    if hd % 8 == 0:
        qo = t * qkv.shape[1] + h * hd
        ko = ((s * kc.shape[1] + j) * kc.shape[2] + kh) * hd
        a = vzero()
        for i0 in range(0, hd, 8):
            a = vfma(vload(qkv, qo + i0), _kv8(kc, ko + i0, half), a)
        return np.float64(vsum(a))
    dot = np.float32(0.0)
    for i in range(hd):
        dot += qkv[t, h * hd + i] * _cached(kc, s, j, kh, i, half)
    return np.float64(dot)


# Positions ahead whose cached key (value) row each step prefetches: one kv head's rows
# are 128 of every 384 bytes (SmolLM2), a stride the hardware prefetcher follows poorly.
PREFETCH_ROWS = 16


@njit(inline="always")
def _score_out(a, sc, i, scale, cap, top):
    """Lane sums of a scaled (and capped) into sc[i]; the running maximum."""
    v = vsum_tree(a) * np.float32(scale)
    if cap:
        v = np.float32(cap * np.tanh(v / cap))
    sc[i] = v
    return max(top, v)


@njit(inline="always")
def _prefetch_rows(kc, vc, nxt, q, n, step, hd):
    """Ask for the key and value lines of rows q .. q + n - 1 of a task (``_task_rows``:
    its first key row at flat offset nxt[0], nxt[1] rows; none when that is 0). Inside
    a decode step those lines come from memory: a layer's rows of 8 sequences are 0.6
    MB, and the step's 90 MB of weights evict them from L3."""
    per_line = 64 // kc.itemsize
    for r in range(q, min(q + n, nxt[1])):
        o = nxt[0] + r * step
        for i in range(0, hd, per_line):
            prefetch(kc, o + i)
            prefetch(vc, o + i)
        if (hd * kc.itemsize) % 64:  # a row that is not whole lines may end in another
            prefetch(kc, o + hd - 1)
            prefetch(vc, o + hd - 1)


@njit(inline="always")
def _scores(qkv, qo, hd, kc, vc, row, step, lo, p, sc, so, c, scale, cap, half, nh, nxt):
    """Scores of ``nh`` (1 to 3, a constant) query heads at qkv's offsets qo, qo + hd,
    qo + 2 hd against the cached keys of positions lo .. p into sc (head h's run at so +
    h * c); each key row is widened once for the heads (vcvtph2ps had bound the loop:
    8 a position and head). Four positions at a time: 4 x nh independent fma chains.
    Each score is the sum of its own chain, as alone. Returns the heads' maxima.

    Meanwhile the next task's rows (``nxt``: _prefetch_rows) are asked for, four for
    every four positions, so their misses overlap this task's arithmetic: asked all at
    once, a task's 400 lines filled the load queue and the core waited for them."""
    m0 = m1 = m2 = np.float32(-np.inf)
    j = lo
    while j + 3 <= p:
        ko = (row + j * kc.shape[2]) * hd
        _prefetch_rows(kc, vc, nxt, j - lo, 4, step, hd)
        a00, a01, a02, a03 = vzero(), vzero(), vzero(), vzero()
        a10, a11, a12, a13 = vzero(), vzero(), vzero(), vzero()
        a20, a21, a22, a23 = vzero(), vzero(), vzero(), vzero()
        for i0 in range(0, hd, 8):
            k0, k1 = _kv8(kc, ko + i0, half), _kv8(kc, ko + step + i0, half)
            k2, k3 = _kv8(kc, ko + 2 * step + i0, half), _kv8(kc, ko + 3 * step + i0, half)
            q = vload(qkv, qo + i0)
            a00, a01 = vfma(q, k0, a00), vfma(q, k1, a01)
            a02, a03 = vfma(q, k2, a02), vfma(q, k3, a03)
            if nh > 1:
                q = vload(qkv, qo + hd + i0)
                a10, a11 = vfma(q, k0, a10), vfma(q, k1, a11)
                a12, a13 = vfma(q, k2, a12), vfma(q, k3, a13)
            if nh > 2:
                q = vload(qkv, qo + 2 * hd + i0)
                a20, a21 = vfma(q, k0, a20), vfma(q, k1, a21)
                a22, a23 = vfma(q, k2, a22), vfma(q, k3, a23)
        m0 = _score_out(a00, sc, so + j, scale, cap, m0)
        m0 = _score_out(a01, sc, so + j + 1, scale, cap, m0)
        m0 = _score_out(a02, sc, so + j + 2, scale, cap, m0)
        m0 = _score_out(a03, sc, so + j + 3, scale, cap, m0)
        if nh > 1:
            m1 = _score_out(a10, sc, so + c + j, scale, cap, m1)
            m1 = _score_out(a11, sc, so + c + j + 1, scale, cap, m1)
            m1 = _score_out(a12, sc, so + c + j + 2, scale, cap, m1)
            m1 = _score_out(a13, sc, so + c + j + 3, scale, cap, m1)
        if nh > 2:
            m2 = _score_out(a20, sc, so + 2 * c + j, scale, cap, m2)
            m2 = _score_out(a21, sc, so + 2 * c + j + 1, scale, cap, m2)
            m2 = _score_out(a22, sc, so + 2 * c + j + 2, scale, cap, m2)
            m2 = _score_out(a23, sc, so + 2 * c + j + 3, scale, cap, m2)
        j += 4
    while j <= p:
        ko = (row + j * kc.shape[2]) * hd
        _prefetch_rows(kc, vc, nxt, j - lo, 1, step, hd)
        a00, a10, a20 = vzero(), vzero(), vzero()
        for i0 in range(0, hd, 8):
            k0 = _kv8(kc, ko + i0, half)
            a00 = vfma(vload(qkv, qo + i0), k0, a00)
            if nh > 1:
                a10 = vfma(vload(qkv, qo + hd + i0), k0, a10)
            if nh > 2:
                a20 = vfma(vload(qkv, qo + 2 * hd + i0), k0, a20)
        m0 = _score_out(a00, sc, so + j, scale, cap, m0)
        if nh > 1:
            m1 = _score_out(a10, sc, so + c + j, scale, cap, m1)
        if nh > 2:
            m2 = _score_out(a20, sc, so + 2 * c + j, scale, cap, m2)
        j += 1
    _prefetch_rows(kc, vc, nxt, p + 1 - lo, nxt[1], step, hd)  # a next task longer than this
    return m0, m1, m2


@njit(inline="always")
def _softmax(sc, base, n, top):
    """sc[base .. base + n - 1] = softmax of the scores there (their maximum: top)."""
    tops = vsplat(top)
    tot = vzero()
    for j0 in range(0, n, 8):
        e = vkeep_n(vexp(vsub(vload_n(sc, base + j0, n - j0), tops)), n - j0)
        vstore_n(sc, base + j0, e, n - j0)
        tot = vadd(tot, e)
    inv = vsplat(np.float32(1.0) / vsum_tree(tot))
    for j0 in range(0, n, 8):  # 8 at a time: the scalar loop had been a third of it
        vstore_n(sc, base + j0, vmul(vload_n(sc, base + j0, n - j0), inv), n - j0)


@njit(inline="always")
def _attend_group_vec(qkv, t, s, p, lo, kh, group, kc, vc, out, sc, acc, hd, scale, cap, half,
                      nxt):  # fmt: skip
    """Row t's query heads kh * group .. kh * group + group - 1 (the ones kv head kh
    serves) over positions lo .. p of slot s, on 8-lane vectors: scores into sc (float32,
    one run of C per head), softmax with vexp, then each value row read once for the
    whole group. sc's runs and acc (group x hd float32) are scratch; the next task's rows
    (``nxt``) are prefetched during the first pass over the keys."""
    n = p + 1 - lo
    c = kc.shape[1]
    row = (s * c) * kc.shape[2] + kh
    step = kc.shape[2] * hd  # flat distance between positions
    for g0 in range(0, group, 3):  # scores of up to 3 heads per pass over the keys
        nh = min(3, group - g0)
        qo = t * qkv.shape[1] + (kh * group + g0) * hd
        nx = (nxt[0], nxt[1] if g0 == 0 else 0)  # asked for in the first pass
        if nh == 3:
            t0, t1, t2 = _scores(qkv, qo, hd, kc, vc, row, step, lo, p, sc, g0 * c - lo,
                                 c, scale, cap, half, 3, nx)  # fmt: skip
        elif nh == 2:
            t0, t1, t2 = _scores(qkv, qo, hd, kc, vc, row, step, lo, p, sc, g0 * c - lo,
                                 c, scale, cap, half, 2, nx)  # fmt: skip
        else:
            t0, t1, t2 = _scores(qkv, qo, hd, kc, vc, row, step, lo, p, sc, g0 * c - lo,
                                 c, scale, cap, half, 1, nx)  # fmt: skip
        for g in range(g0, g0 + nh):
            _softmax(sc, g * c, n, t0 if g == g0 else (t1 if g == g0 + 1 else t2))
    if hd % 32 == 0:  # 32-wide slices of up to 3 heads held in 12 registers over every
        # position: each value slice widened once for the heads (8 vcvtph2ps a position
        # and head had bound the loop) in 12 independent chains (the sums in acc were a
        # load and a store per fma): the same sums in the same order
        for g0 in range(0, group, 3):
            nh = min(3, group - g0)
            oo = t * out.shape[1] + (kh * group + g0) * hd
            for i0 in range(0, hd, 32):
                if nh == 3:
                    _weighted_sums(vc, row, step, lo, p, sc, g0 * c - lo, c, out, oo + i0, i0,
                                   hd, half, 3)  # fmt: skip
                elif nh == 2:
                    _weighted_sums(vc, row, step, lo, p, sc, g0 * c - lo, c, out, oo + i0, i0,
                                   hd, half, 2)  # fmt: skip
                else:
                    _weighted_sums(vc, row, step, lo, p, sc, g0 * c - lo, c, out, oo + i0, i0,
                                   hd, half, 1)  # fmt: skip
        return
    for i in range(group * hd):  # head sizes that are not a multiple of 32: sums in acc
        acc[i] = 0.0
    for j in range(lo, p + 1):
        vo_ = (row + j * vc.shape[2]) * hd
        prefetch(vc, vo_ + PREFETCH_ROWS * step)
        for g in range(group):
            w8 = vsplat(sc[g * c + j - lo])
            ao = g * hd
            for i0 in range(0, hd, 8):
                vstore(acc, ao + i0, vfma(w8, _kv8(vc, vo_ + i0, half), vload(acc, ao + i0)))
    for g in range(group):
        for i in range(hd):
            out[t, (kh * group + g) * hd + i] = acc[g * hd + i]


@njit(inline="always")
def _weighted_sums(vc, row, step, lo, p, sc, so, c, out, oo, i0, hd, half, nh):
    """For ``nh`` (1 to 3, a constant) heads h: out[oo + h * hd .. + 31] = the sum over
    positions j = lo .. p of sc[so + h * c + j] times the cached value row's slice i0 ..
    i0 + 31, in position order from zero (as the acc loop)."""
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    b0, b1, b2, b3 = vzero(), vzero(), vzero(), vzero()
    d0, d1, d2, d3 = vzero(), vzero(), vzero(), vzero()
    for j in range(lo, p + 1):
        vo_ = (row + j * vc.shape[2]) * hd + i0
        v0, v1 = _kv8(vc, vo_, half), _kv8(vc, vo_ + 8, half)
        v2, v3 = _kv8(vc, vo_ + 16, half), _kv8(vc, vo_ + 24, half)
        w = vsplat(sc[so + j])
        a0, a1, a2, a3 = vfma(w, v0, a0), vfma(w, v1, a1), vfma(w, v2, a2), vfma(w, v3, a3)
        if nh > 1:
            w = vsplat(sc[so + c + j])
            b0, b1, b2, b3 = vfma(w, v0, b0), vfma(w, v1, b1), vfma(w, v2, b2), vfma(w, v3, b3)
        if nh > 2:
            w = vsplat(sc[so + 2 * c + j])
            d0, d1, d2, d3 = vfma(w, v0, d0), vfma(w, v1, d1), vfma(w, v2, d2), vfma(w, v3, d3)
    for h, (x0, x1, x2, x3) in enumerate(((a0, a1, a2, a3), (b0, b1, b2, b3),
                                          (d0, d1, d2, d3))):  # fmt: skip
        if h < nh:
            o = oo + h * hd
            vstore(out, o, x0)
            vstore(out, o + 8, x1)
            vstore(out, o + 16, x2)
            vstore(out, o + 24, x3)


@njit(inline="always")
def _attend_head_scalar(qkv, t, s, p, lo, h, kh, kc, vc, out, sc, acc, hd, scale, cap, half):
    """One query head in scalar chains (head sizes that are not a multiple of 8)."""
    top = -np.inf
    for j in range(lo, p + 1):
        v = _score(qkv, t, h, kc, s, j, kh, hd, half) * scale
        if cap:
            v = cap * np.tanh(v / cap)
        sc[j - lo] = v
        top = max(top, v)
    total = 0.0
    for j in range(p + 1 - lo):
        e = np.exp(np.float64(sc[j]) - top)
        sc[j] = e
        total += e
    for i in range(hd):
        acc[i] = 0.0
    for j in range(lo, p + 1):
        wgt = np.float32(sc[j - lo] / total)
        for i in range(hd):
            acc[i] += wgt * _cached(vc, s, j, kh, i, half)
    for i in range(hd):
        out[t, h * hd + i] = acc[i]


@njit(inline="always")
def _task_rows(kc, slot, pos, window, t, kh, hd, real):
    """(flat offset of its first key row, rows) of task (row t, kv head kh), (0, 0) when
    there is no such task (not ``real``) or its row is padding."""
    if not real or slot[t] < 0:
        return 0, 0
    p = pos[t]
    lo = max(0, p - window + 1) if window else 0
    return ((slot[t] * kc.shape[1] + lo) * kc.shape[2] + kh) * hd, p + 1 - lo


@njit(parallel=True, cache=True)
def attention_rows(qkv, qkv_bits, pos, slot, kc, vc, out, sc, acc, heads, kvh, hd, scale,
                   window, cap, half):  # fmt: skip
    """The ``attention`` op (kernels/ref/llm.py) over caches kc, vc [S, C, Hkv, D]:
    float32, or halves as uint16 bits (``half``). ``qkv_bits`` is qkv viewed as uint32
    (for the rounding to half); ``sc`` (n x group x C float32, group = heads / kv heads)
    and ``acc`` (n x group x D float32) scratch for n workers, which take the (row, kv
    head) tasks in turn: the bind gives as many copies as threads run (n = 1: serial;
    a bundle planned before workers had one). When D is a multiple of 8 the dot
    products, the softmax's exp and the weighted sum run on 8-lane vectors
    (simd.Ops(8): fixed lanes, so every CPU sums in the same order), and the query heads
    sharing a kv head are taken together so each cached value row is read once for all
    of them. SmolLM2 at depth 2048 (9 heads, 3 kv heads of 64, f16 cache, 1 thread):
    0.27 ms a layer with a scalar float64 exp per score and each head on its own. A
    task's sums are the same whichever worker runs it."""
    t_rows = qkv.shape[0]
    ko, vo = heads * hd, (heads + kvh) * hd
    for t in range(t_rows):  # every row checked before anything is stored
        if slot[t] >= kc.shape[0] or (slot[t] >= 0 and not 0 <= pos[t] < kc.shape[1]):
            raise IndexError("attention: a slot or position outside the KV cache")
    w_ = kvh * hd  # a position's keys (values): one contiguous run of the cache
    for t in range(t_rows):
        s = slot[t]
        if s < 0:
            continue
        p = pos[t]
        co = (s * kc.shape[1] + p) * w_
        if half and w_ % 8 == 0:  # 8 at a time in hardware: the scalar rounding had been
            # 11 of 64 us of an 8-row SmolLM2 layer
            for j in range(0, w_, 8):
                vstoreh(kc, co + j, vload(qkv, t * qkv.shape[1] + ko + j))
                vstoreh(vc, co + j, vload(qkv, t * qkv.shape[1] + vo + j))
            continue
        for j in range(w_):
            kh, i = j // hd, j % hd
            if half:
                kc[s, p, kh, i] = f32_bits_to_half(qkv_bits[t, ko + j])
                vc[s, p, kh, i] = f32_bits_to_half(qkv_bits[t, vo + j])
            else:
                kc[s, p, kh, i] = qkv[t, ko + j]
                vc[s, p, kh, i] = qkv[t, vo + j]
    group = heads // kvh
    per_sc, per_acc = group * kc.shape[1], group * hd
    workers = max(1, min(sc.shape[0] // per_sc, acc.shape[0] // per_acc))
    tasks = t_rows * kvh
    for w in prange(workers):
        scw = sc[w * per_sc : (w + 1) * per_sc]
        accw = acc[w * per_acc : (w + 1) * per_acc]
        step = kc.shape[2] * hd  # flat distance between positions
        first = _task_rows(kc, slot, pos, window, w // kvh, w % kvh, hd, w < tasks)
        _prefetch_rows(kc, vc, first, 0, first[1], step, hd)  # the first task: at once
        for task in range(w, tasks, workers):
            t, kh = task // kvh, task % kvh
            nt = task + workers  # the next task's rows arrive while this one runs
            nxt = _task_rows(kc, slot, pos, window, nt // kvh, nt % kvh, hd, nt < tasks)
            if hd % 8 != 0:  # the scalar path asks for them all at once
                _prefetch_rows(kc, vc, nxt, 0, nxt[1], step, hd)
            s = slot[t]
            if s < 0:
                for j in range(kh * group * hd, (kh + 1) * group * hd):
                    out[t, j] = 0.0
                continue
            p = pos[t]
            lo = max(0, p - window + 1) if window else 0
            if hd % 8 == 0:
                _attend_group_vec(qkv, t, s, p, lo, kh, group, kc, vc, out, scw, accw, hd,
                                  scale, cap, half, nxt)  # fmt: skip
            else:
                for g in range(group):
                    _attend_head_scalar(qkv, t, s, p, lo, kh * group + g, kh, kc, vc, out, scw,
                                        accw, hd, scale, cap, half)  # fmt: skip


# The kernels the backend binds (kernels/cpu/native.py; AOT signatures in abi.py).
KERNELS = ("norm_rows", "rope_rows", "glu_rows", "embed_rows", "embed_rows_half", "halves_from_f32",
           "attention_rows")  # fmt: skip
