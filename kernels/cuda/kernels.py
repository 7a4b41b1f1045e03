"""numba.cuda kernels of the cuda backend (imported only when that backend binds).

Written once for both places they run: on a GPU (numba compiles them to PTX) and in
numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where each thread is a Python
thread. Every kernel is a grid-stride loop, so the launch shape is free: the GPU gets
one thread per element, the simulator a handful of threads that each loop (the
simulator's cost is per thread, ~0.2 ms each, not per element).

Arithmetic is float32 (literals wrapped in ``f32``) because Jetson GPUs run float64 at
1/32 of the float32 rate; reductions whose length is data-dependent (softmax, means)
accumulate in float64, which costs nothing measurable at their sizes.

Epilogue flag bits match ``kernels/cpu/native.py``'s ``K.HAS_*`` (bias 1, scale 2, residual 4).
"""

from __future__ import annotations

import math

from numba import cuda, float32, float64, int64

from .. import portable
from ..activations import ERF_P, ERF_Q
from ..flags import HAS_BIAS, HAS_RES, HAS_SCALE

# numba's CUDA simulator runs each CUDA thread as a Python thread and, on every device
# function call, iterates that function's module globals to swap in its fake `cuda`.
# The first NumPy RuntimeWarning raised in a frame of such a module (NaN arithmetic in
# the IEEE kernel cases) inserts `__warningregistry__` into the same dict, and a thread
# iterating it then fails with "dictionary changed size during iteration" (attention's
# ieee_prefill_chunk failed that way once in CI and once in a full run here). Made up
# front, the key is never inserted then.
for _globs in (globals(), vars(portable)):
    _globs.setdefault("__warningregistry__", {})

f32 = float32
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = ERF_P  # constants folded into the device code
_Q0, _Q1, _Q2, _Q3, _Q4 = ERF_Q


@cuda.jit(device=True, inline=True)
def unravel6(t, s1, s2, s3, s4, s5):
    """The 6-D index of flat (C-order) position t in a shape (_, s1, s2, s3, s4, s5)."""
    i5 = t % s5
    t //= s5
    i4 = t % s4
    t //= s4
    i3 = t % s3
    t //= s3
    i2 = t % s2
    t //= s2
    return t // s1, t % s1, i2, i3, i4, i5


@cuda.jit(device=True, inline=True)
def clamp_nan(v, lo, hi):
    """v clamped to [lo, hi] with a NaN kept (min/max would drop it)."""
    v = lo if v < lo else v
    return hi if v > hi else v


@cuda.jit(device=True, inline=True)
def nan_max(m, v):
    """The larger of m and v, NaN once seen kept (a max pool's running value)."""
    return v if v > m or v != v else m


@cuda.jit(device=True, inline=True)
def act(v, code, a, b):
    """The activation epilogues of kernels/activations.py, by integer code."""
    if code == 0:
        return v
    if code == 1:  # NaN kept, as ONNX Runtime's Relu / Clip / HardSigmoid (and the CPU's)
        return f32(0.0) if v <= f32(0.0) else v
    if code == 2:
        return v if v >= f32(0.0) else v * a
    if code == 3:
        return clamp_nan(v, a, b)
    if code == 4:  # the stable form: exp of a non-positive number never overflows
        if v >= f32(0.0):
            return f32(1.0) / (f32(1.0) + math.exp(-v))
        e = math.exp(v)
        return e / (f32(1.0) + e)
    if code == 5:
        return math.tanh(v)
    if code == 6:
        return clamp_nan(v * a + b, f32(0.0), f32(1.0))
    if code == 7:
        return v * clamp_nan(v * f32(1 / 6) + f32(0.5), f32(0.0), f32(1.0))
    if code == 8:  # silu
        return v / (f32(1.0) + math.exp(-v))
    if code == 9:  # gelu, erf as kernels/activations.py ERF_P / ERF_Q (the CPU's)
        t = v * f32(0.7071067811865476)
        t = f32(-4.0) if t < f32(-4.0) else t
        t = f32(4.0) if t > f32(4.0) else t
        t2 = t * t
        p = f32(_P0)
        p = p * t2 + f32(_P1)
        p = p * t2 + f32(_P2)
        p = p * t2 + f32(_P3)
        p = p * t2 + f32(_P4)
        p = p * t2 + f32(_P5)
        p = p * t2 + f32(_P6)
        q = f32(_Q0)
        q = q * t2 + f32(_Q1)
        q = q * t2 + f32(_Q2)
        q = q * t2 + f32(_Q3)
        q = q * t2 + f32(_Q4)
        return f32(0.5) * v * (f32(1.0) + t * p / q)
    return v


# --- weight decoding (run every inference into scratch; weights stay int8/fp16) --------


@cuda.jit
def decode_i8(src, dst):
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = f32(src[i])


@cuda.jit
def decode_f16(src, dst):
    """IEEE half bits (uint16) -> float32 bits (uint32), exact for every value
    (subnormals, signed zeros, inf/nan) and independent of the GPU's fp16 support."""
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        h = int64(src[i])
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e == 0:
            if m == 0:
                bits = sign
            else:  # subnormal half: normalise into a float32 exponent
                e32 = 113
                while (m & 0x400) == 0:
                    m <<= 1
                    e32 -= 1
                bits = sign | (e32 << 23) | ((m & 0x3FF) << 13)
        elif e == 31:
            bits = sign | 0x7F800000 | (m << 13)
        else:
            bits = sign | ((e + 112) << 23) | (m << 13)
        dst[i] = bits


@cuda.jit
def decode_bf16(src, dst):
    """bfloat16 bits (uint16) -> float32 bits (uint32): the top half of the word."""
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = int64(src[i]) << 16


@cuda.jit(device=True, inline=True)
def half_to_f32(h):
    """IEEE half bits -> float32 value, exactly (int4 group scales)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        v = f32(math.inf) if m == 0 else f32(math.nan)
    elif e == 0:
        v = f32(m) * f32(5.9604644775390625e-08)  # 2**-24
    else:
        v = f32(m + 1024) * f32(2.0 ** (e - 25))
    return -v if h & 0x8000 else v


@cuda.jit
def decode_q4(src, scale, dst, rows, cols):
    """int4 weights (wtypes.py) -> float32 at dst[rows[n] + cols[k]], k < cols.size: one
    thread per stored byte, which holds weights j and j + 16 of its 32-weight run."""
    n_, half = src.shape
    k_ = cols.size
    group = half * 2 // scale.shape[1]
    for t in range(cuda.grid(1), n_ * half, cuda.gridsize(1)):
        n = t // half
        b = t - n * half
        run = b // 16
        j = b - run * 16
        k0 = run * 32 + j
        byte = int64(src[n, b])
        s = half_to_f32(int64(scale[n, k0 // group]))
        if k0 < k_:
            dst[rows[n] + cols[k0]] = f32((byte & 15) - 8) * s
        if k0 + 16 < k_:
            dst[rows[n] + cols[k0 + 16]] = f32((byte >> 4) - 8) * s


# --- conv pieces ----------------------------------------------------------------------


@cuda.jit
def im2col(x, cols, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow):
    """x[C, H, W] -> cols[C*kh*kw, oh*ow] with zeros where the window is in the pads."""
    h, w = x.shape[1], x.shape[2]
    p = oh * ow
    n = cols.shape[0] * p
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        r = t // p
        q = t - r * p
        c = r // (kh * kw)
        k = r - c * (kh * kw)
        i = k // kw
        j = k - i * kw
        oy = q // ow
        ox = q - oy * ow
        iy = oy * sh - pt + i * dh
        ix = ox * sw - pl + j * dw
        v = f32(0.0)
        if 0 <= iy < h and 0 <= ix < w:
            v = x[c, iy, ix]
        cols[r, q] = v


@cuda.jit
def epilogue_rows(y, bias, scale, res, flags, code, a, b):
    """y[N, C, P] = act(y * scale[c] + bias[c] + res[n, c, p]) in place."""
    cn, pn = y.shape[1], y.shape[2]
    n = y.shape[0] * cn * pn
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        ni = t // (cn * pn)
        rem = t - ni * cn * pn
        c = rem // pn
        q = rem - c * pn
        v = y[ni, c, q]
        if flags & HAS_SCALE:
            v = v * scale[c]
        if flags & HAS_BIAS:
            v = v + bias[c]
        if flags & HAS_RES:
            v = v + res[ni, c, q]
        y[ni, c, q] = act(v, code, a, b)


@cuda.jit
def epilogue_cols(y, bias, scale, flags, code, a, b):
    """y[M, N] = act(y * scale[n] + bias[n]) in place (linear)."""
    cn = y.shape[1]
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        m = t // cn
        c = t - m * cn
        v = y[m, c]
        if flags & HAS_SCALE:
            v = v * scale[c]
        if flags & HAS_BIAS:
            v = v + bias[c]
        y[m, c] = act(v, code, a, b)


@cuda.jit
def dwconv(x, w, bias, scale, res, y, sh, sw, pt, pl, dh, dw, flags, code, a, b):
    """Depthwise conv, one output element per loop turn, epilogue fused.
    x[N, C, H, W], w[C, 1, kh, kw] (float32 or int8; the int8 scale is in the epilogue)."""
    cn, h, wd = x.shape[1], x.shape[2], x.shape[3]
    kh, kw = w.shape[2], w.shape[3]
    oh, ow = y.shape[2], y.shape[3]
    n = y.size
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        ox = t % ow
        r = t // ow
        oy = r % oh
        r = r // oh
        c = r % cn
        ni = r // cn
        acc = f32(0.0)
        for i in range(kh):
            iy = oy * sh - pt + i * dh
            if 0 <= iy < h:
                for j in range(kw):
                    ix = ox * sw - pl + j * dw
                    if 0 <= ix < wd:
                        acc += x[ni, c, iy, ix] * f32(w[c, 0, i, j])
        if flags & HAS_SCALE:
            acc = acc * scale[c]
        if flags & HAS_BIAS:
            acc = acc + bias[c]
        if flags & HAS_RES:
            acc = acc + res[ni, c, oy, ox]
        y[ni, c, oy, ox] = act(acc, code, a, b)


# --- elementwise ----------------------------------------------------------------------


_math_fn = cuda.jit(device=True)(portable.math_fn)


@cuda.jit
def math_into(x, y, code, a, b):
    """The math op's function ``code`` (kernels/mathfns.py), in float64 as the CPU."""
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        y[i] = _math_fn(code, float64(x[i]), a, b)


@cuda.jit
def act_into(x, y, code, a, b):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        y[i] = act(x[i], code, a, b)


@cuda.jit
def binary6(x, z, y, kind, code, a, b):
    """y = act(x op z) over 6-D views; x and z may broadcast (stride-0 axes)."""
    s1, s2, s3, s4, s5 = y.shape[1], y.shape[2], y.shape[3], y.shape[4], y.shape[5]
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        i0, i1, i2, i3, i4, i5 = unravel6(t, s1, s2, s3, s4, s5)
        u = x[i0, i1, i2, i3, i4, i5]
        v = z[i0, i1, i2, i3, i4, i5]
        if kind == 0:
            o = u + v
        elif kind == 1:
            o = u - v
        elif kind == 2:
            o = u * v
        elif kind == 3:
            o = u / v
        elif kind == 4:  # max/min propagate NaN, as the CPU's
            o = u + v if u != u or v != v else max(u, v)
        elif kind == 5:
            o = u + v if u != u or v != v else min(u, v)
        else:
            o = u**v
        y[i0, i1, i2, i3, i4, i5] = act(o, code, a, b)


@cuda.jit
def copy6(src, dst):
    """dst = src over two 6-D views of one shape (either may be strided): transpose,
    concat parts, reshape copies."""
    s1, s2, s3, s4, s5 = dst.shape[1], dst.shape[2], dst.shape[3], dst.shape[4], dst.shape[5]
    for t in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        i0, i1, i2, i3, i4, i5 = unravel6(t, s1, s2, s3, s4, s5)
        dst[i0, i1, i2, i3, i4, i5] = src[i0, i1, i2, i3, i4, i5]


@cuda.jit
def channel_affine(x, scale, shift, y, code, a, b):
    """y[N, C, P] = act(x * scale[c] + shift[c])."""
    cn, pn = x.shape[1], x.shape[2]
    for t in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        ni = t // (cn * pn)
        rem = t - ni * cn * pn
        c = rem // pn
        q = rem - c * pn
        y[ni, c, q] = act(x[ni, c, q] * scale[c] + shift[c], code, a, b)


@cuda.jit
def pad6(x, y, before, mode, value):
    """y = pad(x) over 6-D views; mode 0 constant, 1 reflect, 2 edge (ONNX Pad)."""
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        src = cuda.local.array(6, int64)
        r = t
        inside = True
        for d in range(5, -1, -1):
            i = r % y.shape[d] - before[d]
            r //= y.shape[d]
            n = x.shape[d]
            if i < 0 or i >= n:
                if mode == 0:
                    inside = False
                elif mode == 1:  # reflect without repeating the edge (pads < n)
                    i = -i if i < 0 else 2 * (n - 1) - i
                else:
                    i = 0 if i < 0 else n - 1
            src[d] = i
        o = t
        i5 = o % y.shape[5]
        o //= y.shape[5]
        i4 = o % y.shape[4]
        o //= y.shape[4]
        i3 = o % y.shape[3]
        o //= y.shape[3]
        i2 = o % y.shape[2]
        o //= y.shape[2]
        i1 = o % y.shape[1]
        i0 = o // y.shape[1]
        if inside:
            y[i0, i1, i2, i3, i4, i5] = x[src[0], src[1], src[2], src[3], src[4], src[5]]
        else:
            y[i0, i1, i2, i3, i4, i5] = value


# --- reductions -----------------------------------------------------------------------


@cuda.jit
def softmax3(x, y, log):
    """Softmax over axis 1 of x[outer, n, inner]; with ``log`` the log-softmax, as the
    CPU's (float64 sums); one (outer, inner) row per loop turn."""
    n, inner = x.shape[1], x.shape[2]
    rows = x.shape[0] * inner
    for t in range(cuda.grid(1), rows, cuda.gridsize(1)):
        o = t // inner
        q = t - o * inner
        m = x[o, 0, q]
        for k in range(1, n):
            m = max(m, x[o, k, q])
        s = float64(0.0)
        for k in range(n):
            e = math.exp(float64(x[o, k, q]) - float64(m))
            if not log:
                y[o, k, q] = e
            s += e
        if log:
            ls = math.log(s)
            for k in range(n):
                y[o, k, q] = f32(float64(x[o, k, q]) - float64(m) - ls)
        else:
            inv = 1.0 / s
            for k in range(n):
                y[o, k, q] = f32(y[o, k, q] * inv)



@cuda.jit
def conv_transpose(x, w, bias, y, sh, sw, pt, pl, dh, dw, group, has_bias):
    """ConvTranspose as the CPU's gather: one output element per loop turn."""
    c_, h_, w_ = x.shape[1], x.shape[2], x.shape[3]
    cog, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    co_, oh, ow = y.shape[1], y.shape[2], y.shape[3]
    cig = c_ // group
    for q in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ox = q % ow
        r = q // ow
        oy = r % oh
        r = r // oh
        o = r % co_
        n = r // co_
        gi = o // cog
        oc = o - gi * cog
        s = float64(bias[o]) if has_bias else float64(0.0)
        for ky in range(kh):
            ty = oy + pt - ky * dh
            if ty < 0 or ty % sh != 0 or ty // sh >= h_:
                continue
            iy = ty // sh
            for kx in range(kw):
                tx = ox + pl - kx * dw
                if tx < 0 or tx % sw != 0 or tx // sw >= w_:
                    continue
                ix = tx // sw
                for ci in range(gi * cig, (gi + 1) * cig):
                    s += float64(x[n, ci, iy, ix]) * w[ci, oc, ky, kx]
        y[n, o, oy, ox] = f32(s)


@cuda.jit
def resample3(x, idx, w, y):
    """One axis of a Resize, as the CPU's: y[a, o, b] = sum_t w[o, t] x[a, idx[o, t], b]."""
    n, inner = y.shape[1], y.shape[2]
    for q in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        a = q // (n * inner)
        r = q - a * n * inner
        o = r // inner
        b = r - o * inner
        s = float64(0.0)
        for t in range(idx.shape[1]):
            s += float64(w[o, t]) * x[a, idx[o, t], b]
        y[a, o, b] = f32(s)


@cuda.jit
def global_avgpool(x, y):
    """y[r] = mean(x[r, :]) for x[rows, H*W]."""
    n = x.shape[1]
    for r in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        s = float64(0.0)
        for k in range(n):
            s += x[r, k]
        y[r] = f32(s / n)


@cuda.jit
def reduce_mean6(x, y, nred):
    """Mean over the last ``nred`` axes of a 6-D (possibly transposed) view of x; the
    leading axes are the kept ones, in y's flat order."""
    rcount = 1
    for d in range(6 - nred, 6):
        rcount *= x.shape[d]
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        idx = cuda.local.array(6, int64)
        r = t
        for d in range(5 - nred, -1, -1):
            idx[d] = r % x.shape[d]
            r //= x.shape[d]
        s = float64(0.0)
        for k in range(rcount):
            r = k
            for d in range(5, 5 - nred, -1):
                idx[d] = r % x.shape[d]
                r //= x.shape[d]
            s += x[idx[0], idx[1], idx[2], idx[3], idx[4], idx[5]]
        y[t] = f32(s / rcount)


# --- pooling ----------------------------------------------------------------------------


@cuda.jit
def maxpool(x, y, kh, kw, sh, sw, pt, pl, dh, dw):
    """Max over the real pixels of each window (pads and the ceil_mode overhang are
    -inf in the reference, so they never win)."""
    cn, h, w = x.shape[1], x.shape[2], x.shape[3]
    oh, ow = y.shape[2], y.shape[3]
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ox = t % ow
        r = t // ow
        oy = r % oh
        r = r // oh
        c = r % cn
        ni = r // cn
        m = f32(-math.inf)
        for i in range(kh):
            iy = oy * sh - pt + i * dh
            if 0 <= iy < h:
                for j in range(kw):
                    ix = ox * sw - pl + j * dw
                    if 0 <= ix < w:
                        m = nan_max(m, x[ni, c, iy, ix])
        y[ni, c, oy, ox] = m


@cuda.jit
def avgpool(x, y, kh, kw, sh, sw, pt, pl, pb, pr, include_pad):
    """ONNX AveragePool: count_include_pad counts the explicit pads, never the ceil_mode
    overhang past them."""
    cn, h, w = x.shape[1], x.shape[2], x.shape[3]
    oh, ow = y.shape[2], y.shape[3]
    for t in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ox = t % ow
        r = t // ow
        oy = r % oh
        r = r // oh
        c = r % cn
        ni = r // cn
        s = f32(0.0)
        cnt = 0
        for i in range(kh):
            iy = oy * sh - pt + i
            for j in range(kw):
                ix = ox * sw - pl + j
                if 0 <= iy < h and 0 <= ix < w:
                    s += x[ni, c, iy, ix]
                    cnt += 1
                elif include_pad != 0 and -pt <= iy < h + pb and -pl <= ix < w + pr:
                    cnt += 1
        y[ni, c, oy, ox] = s / f32(cnt)


# --- decoder-LLM ops (references: kernels/ref/llm.py; the cpu loops: kernels/cpu/llm.py) --
# Row-wise sums (norms, attention scores and softmax) accumulate in float64, like the
# references; their lengths are a row (D) or a sequence (<= the context).


# kernels/portable.py, compiled for this backend
f32_bits_to_half = cuda.jit(device=True, inline=True)(portable.f32_bits_to_half)
_norm_row = cuda.jit(device=True, inline=True)(portable.norm_row)


@cuda.jit
def norm_rows(x, w, b, y, eps, layer, has_b, group):
    """One row per loop turn: (x - mean) / sqrt(mean((x - mean)²) + eps) * w (+ b) over
    each run of ``group`` columns of the first len(w) (portable.norm_row)."""
    for r in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        _norm_row(x, w, b, y, r, eps, layer, has_b, group)


@cuda.jit
def rope_rows(x, pos, cos, sin, y, heads, hd):
    """One (row, column) per loop turn: rotate-half RoPE of the first ``heads`` heads;
    the other columns copied (y may be x: each turn reads only its own pair's inputs
    and writes one of them, so a pair is split between two turns only out of place)."""
    half = cos.shape[1]
    w = x.shape[1]
    for q in range(cuda.grid(1), x.shape[0] * w, cuda.gridsize(1)):
        t = q // w
        col = q - t * w
        h = col // hd
        i = col - h * hd
        if h >= heads or i >= 2 * half:
            y[t, col] = x[t, col]
        elif i < half:
            p = pos[t]
            x1 = float64(x[t, col])
            x2 = float64(x[t, col + half])
            c = float64(cos[p, i])
            s = float64(sin[p, i])
            y[t, col] = x1 * c - x2 * s
            y[t, col + half] = x2 * c + x1 * s


@cuda.jit
def glu_rows(x, y, act_code):
    f = y.shape[1]
    for q in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        r = q // f
        i = q - r * f
        g = float64(x[r, i])
        if act_code == 0:
            v = g / (1.0 + math.exp(-g))
        else:
            v = 0.5 * g * (1.0 + math.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        y[r, i] = v * x[r, f + i]


@cuda.jit(device=True, inline=True)
def bf16_to_f32(b):
    """bfloat16 bits -> float32 value, exactly (8 exponent bits as float32's, 7 of
    mantissa)."""
    e = (b >> 7) & 0xFF
    m = b & 0x7F
    if e == 255:
        v = f32(math.inf) if m == 0 else f32(math.nan)
    elif e == 0:
        v = f32(m) * f32(2.0**-133)
    else:
        v = f32(m + 128) * f32(2.0 ** (e - 134))
    return -v if b & 0x8000 else v


@cuda.jit
def embed_rows_half(ids, bits, y, mul, bf16):
    """y[t] = w[ids[t]] * mul for a table of fp16 or bfloat16 bits (uint16)."""
    d = bits.shape[1]
    for q in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        t = q // d
        i = q - t * d
        h = int64(bits[ids[t], i])  # signed: the exponent arithmetic must not wrap
        v = bf16_to_f32(h) if bf16 else half_to_f32(h)
        y[t, i] = float64(v) * mul


@cuda.jit
def embed_rows(ids, w, scale, y, mul, has_scale):
    d = w.shape[1]
    for q in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        t = q // d
        i = q - t * d
        r = ids[t]
        v = f32(w[r, i])
        if has_scale:
            v = v * scale[r]
        y[t, i] = float64(v) * mul




@cuda.jit
def attention_store(qkv, qkv_bits, pos, slot, kc, vc, heads, kvh, hd, half):
    """Each live row's key and value heads into the caches at [slot, pos]."""
    n = kvh * hd
    ko, vo = heads * hd, (heads + kvh) * hd
    for q in range(cuda.grid(1), qkv.shape[0] * n, cuda.gridsize(1)):
        t = q // n
        j = q - t * n
        s = slot[t]
        if s >= 0:
            kh = j // hd
            i = j - kh * hd
            if half:
                kc[s, pos[t], kh, i] = f32_bits_to_half(qkv_bits[t, ko + j])
                vc[s, pos[t], kh, i] = f32_bits_to_half(qkv_bits[t, vo + j])
            else:
                kc[s, pos[t], kh, i] = qkv[t, ko + j]
                vc[s, pos[t], kh, i] = qkv[t, vo + j]


@cuda.jit(device=True, inline=True)
def _cached(c, s, p, kh, i, half):
    if half:
        return float64(half_to_f32(int64(c[s, p, kh, i])))
    return float64(c[s, p, kh, i])


@cuda.jit(device=True, inline=True)
def _score(qkv, t, h, hd, kc, s, j, kh, half, scale, cap):
    """Row t's query head h against cached key j: scaled, tanh-capped when ``cap``."""
    dot = float64(0.0)
    for i in range(hd):
        dot += float64(qkv[t, h * hd + i]) * _cached(kc, s, j, kh, i, half)
    v = dot * scale
    if cap:
        v = cap * math.tanh(v / cap)
    return v


@cuda.jit
def attention_rows(qkv, pos, slot, kc, vc, out, heads, kvh, hd, scale, window, cap, half):
    """One (row, head) per loop turn over the caches (after attention_store): two
    passes over the keys (the largest score, then exp-weighted sums), so no score
    vector is held; one head's output accumulates in a local array (D <= 256)."""
    group = heads // kvh
    for q in range(cuda.grid(1), qkv.shape[0] * heads, cuda.gridsize(1)):
        t = q // heads
        h = q - t * heads
        s = slot[t]
        if s < 0:
            for i in range(hd):
                out[t, h * hd + i] = f32(0.0)
            continue
        p = pos[t]
        lo = max(0, p - window + 1) if window else 0
        kh = h // group
        top = -math.inf
        for j in range(lo, p + 1):
            top = max(top, _score(qkv, t, h, hd, kc, s, j, kh, half, scale, cap))
        acc = cuda.local.array(256, float64)
        for i in range(hd):
            acc[i] = 0.0
        total = float64(0.0)
        for j in range(lo, p + 1):
            e = math.exp(_score(qkv, t, h, hd, kc, s, j, kh, half, scale, cap) - top)
            total += e
            for i in range(hd):
                acc[i] += e * _cached(vc, s, j, kh, i, half)
        for i in range(hd):
            out[t, h * hd + i] = acc[i] / total
