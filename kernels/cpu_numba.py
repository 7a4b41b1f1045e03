"""numba CPU kernels. Each is validated against ``reference.py`` by tests/test_kernels.py.

Conventions: activations are float32 and C-contiguous; optional inputs are passed as
1-element (or 1x1) dummy arrays plus a bit in ``flags`` so that every call has one
type signature (cpu_abi.py lists them for the ahead-of-time build).

No ``fastmath``: without reassociation or FMA contraction every element is computed
in the same order whatever the vector width, so the JIT build, the AOT build shipped
in device executables, and builds for other CPUs give bit-identical results. Loops
are written so the vectoriser can still work (elementwise inner loops).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_abi import HAS_BIAS, HAS_RES, HAS_SCALE


@njit(inline="always")
def act_scalar(v, act, a, b):
    if act == 0:
        return v
    if act == 1:
        return v if v > 0 else np.float32(0)
    if act == 2:
        return v if v >= 0 else v * a
    if act == 3:
        return min(max(v, a), b)
    if act == 4:
        return np.float32(1) / (np.float32(1) + np.exp(-v))
    if act == 5:
        return np.tanh(v)
    if act == 6:
        return min(max(v * a + b, np.float32(0)), np.float32(1))
    # 7: hard_swish
    return v * min(max(v / np.float32(6) + np.float32(0.5), np.float32(0)), np.float32(1))


@njit(parallel=True, cache=True)
def im2col(x, cols, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow):
    """x[C,H,W] -> cols[C*kh*kw, oh*ow], zero outside the image (implicit padding)."""
    c_, h, w = x.shape
    khw = kh * kw
    for r in prange(c_ * khw):
        c = r // khw
        i = (r % khw) // kw
        j = r % kw
        for oy in range(oh):
            iy = oy * sh - pt + i * dh
            base = oy * ow
            if iy < 0 or iy >= h:
                for ox in range(ow):
                    cols[r, base + ox] = 0.0
            else:
                for ox in range(ow):
                    ix = ox * sw - pl + j * dw
                    if ix >= 0 and ix < w:
                        cols[r, base + ox] = x[c, iy, ix]
                    else:
                        cols[r, base + ox] = 0.0


@njit(parallel=True, cache=True)
def epilogue_rows(y, bias, scale, res, flags, act, a, b):
    """In place on y[R, P]: per-row scale and bias, optional residual, activation."""
    r_, p_ = y.shape
    for r in prange(r_):
        s = scale[r] if flags & HAS_SCALE else np.float32(1)
        bb = bias[r] if flags & HAS_BIAS else np.float32(0)
        for p in range(p_):
            v = y[r, p] * s + bb
            if flags & HAS_RES:
                v += res[r, p]
            y[r, p] = act_scalar(v, act, a, b)


@njit(parallel=True, cache=True)
def epilogue_cols(y, bias, scale, flags, act, a, b):
    """In place on y[M, N]: per-column scale and bias, activation (linear layers)."""
    m_, n_ = y.shape
    for m in prange(m_):
        for n in range(n_):
            s = scale[n] if flags & HAS_SCALE else np.float32(1)
            bb = bias[n] if flags & HAS_BIAS else np.float32(0)
            y[m, n] = act_scalar(y[m, n] * s + bb, act, a, b)


@njit(parallel=True, cache=True)
def act_into(x, y, act, a, b):
    """y = act(x) elementwise over flat arrays (x and y may be the same buffer)."""
    for i in prange(x.size):
        y[i] = act_scalar(x[i], act, a, b)


@njit(parallel=True, cache=True)
def dwconv(x, w, bias, scale, res, out, sh, sw, pt, pl, dh, dw, flags, act, a, b):
    """Depthwise conv, one image: x[C,H,W], w[C,1,kh,kw] (float32 or int8), out[C,oh,ow].

    Accumulates whole output rows per tap (the valid column range is computed once per
    tap), so the inner loop has no bounds test and vectorizes at stride 1.
    """
    c_, h, wd = x.shape
    kh, kw = w.shape[2], w.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    for c in prange(c_):
        for oy in range(oh):
            for ox in range(ow):
                out[c, oy, ox] = 0.0
        for i in range(kh):
            for oy in range(oh):
                iy = oy * sh - pt + i * dh
                if iy < 0 or iy >= h:
                    continue
                for j in range(kw):
                    wv = np.float32(w[c, 0, i, j])
                    shift = j * dw - pl
                    # ox range with 0 <= ox*sw + shift < wd
                    lo = 0 if shift >= 0 else (-shift + sw - 1) // sw
                    hi = (wd - 1 - shift) // sw + 1 if wd - 1 - shift >= 0 else 0
                    if hi > ow:
                        hi = ow
                    if hi <= lo:
                        continue
                    # Views starting at the first valid column: indices from 0 upward
                    # let LLVM drop numba's negative-index wraparound and vectorize.
                    orow = out[c, oy, lo:hi]
                    xrow = x[c, iy, lo * sw + shift :]
                    if sw == 1:
                        for k in range(hi - lo):
                            orow[k] += wv * xrow[k]
                    else:
                        for k in range(hi - lo):
                            orow[k] += wv * xrow[k * sw]
        s = scale[c] if flags & HAS_SCALE else np.float32(1)
        bb = bias[c] if flags & HAS_BIAS else np.float32(0)
        for oy in range(oh):
            for ox in range(ow):
                v = out[c, oy, ox] * s + bb
                if flags & HAS_RES:
                    v += res[c, oy, ox]
                out[c, oy, ox] = act_scalar(v, act, a, b)


@njit(parallel=True, cache=True)
def linear_q(x, w, bias, scale, y, flags, act, a, b):
    """y[M,N] = act(x[M,K] @ w[N,K].T * scale + bias) reading int8 weights directly.

    Four output rows share each load of x: at batch 1 this is a GEMV bound by the
    weight read, and the int8 weights are a quarter of the fp32 bytes.
    """
    m_, k_ = x.shape
    n_ = w.shape[0]
    nb = (n_ + 3) // 4
    for blk in prange(nb):
        n0 = blk * 4
        for m in range(m_):
            if n0 + 4 <= n_:
                a0 = np.float32(0)
                a1 = np.float32(0)
                a2 = np.float32(0)
                a3 = np.float32(0)
                for k in range(k_):
                    xv = x[m, k]
                    a0 += xv * np.float32(w[n0, k])
                    a1 += xv * np.float32(w[n0 + 1, k])
                    a2 += xv * np.float32(w[n0 + 2, k])
                    a3 += xv * np.float32(w[n0 + 3, k])
                accs = (a0, a1, a2, a3)
                for t in range(4):
                    n = n0 + t
                    s = scale[n] if flags & HAS_SCALE else np.float32(1)
                    bb = bias[n] if flags & HAS_BIAS else np.float32(0)
                    y[m, n] = act_scalar(accs[t] * s + bb, act, a, b)
            else:
                for n in range(n0, n_):
                    acc = np.float32(0)
                    for k in range(k_):
                        acc += x[m, k] * np.float32(w[n, k])
                    s = scale[n] if flags & HAS_SCALE else np.float32(1)
                    bb = bias[n] if flags & HAS_BIAS else np.float32(0)
                    y[m, n] = act_scalar(acc * s + bb, act, a, b)


@njit(parallel=True, cache=True)
def maxpool(x, out, kh, kw, sh, sw, pt, pl, dh, dw):
    """x[C,H,W] -> out[C,oh,ow]; padding never wins (it is -inf in ONNX semantics)."""
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    for c in prange(c_):
        for oy in range(oh):
            for ox in range(ow):
                m = -np.inf
                for i in range(kh):
                    iy = oy * sh - pt + i * dh
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(kw):
                        ix = ox * sw - pl + j * dw
                        if ix >= 0 and ix < wd:
                            v = x[c, iy, ix]
                            if v > m:
                                m = v
                out[c, oy, ox] = m


@njit(parallel=True, cache=True)
def avgpool(x, out, kh, kw, sh, sw, pt, pl, pb, pr, include_pad):
    """x[C,H,W] -> out[C,oh,ow]. With include_pad, explicit pads count in the divisor
    but the ceil_mode overhang never does (ONNX Runtime's rule)."""
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    for c in prange(c_):
        for oy in range(oh):
            for ox in range(ow):
                s = np.float32(0)
                n = 0
                for i in range(kh):
                    iy = oy * sh - pt + i
                    inside_pad_y = iy >= -pt and iy < h + pb
                    for j in range(kw):
                        ix = ox * sw - pl + j
                        if iy >= 0 and iy < h and ix >= 0 and ix < wd:
                            s += x[c, iy, ix]
                            n += 1
                        elif include_pad and inside_pad_y and ix >= -pl and ix < wd + pr:
                            n += 1
                out[c, oy, ox] = s / n if n > 0 else np.float32(0)


@njit(parallel=True, cache=True)
def global_avgpool(x, out):
    """x[R, P] -> out[R]: mean over the spatial positions of each (n, c) row."""
    r_, p_ = x.shape
    for r in prange(r_):
        s = np.float32(0)
        for p in range(p_):
            s += x[r, p]
        out[r] = s / p_


@njit(parallel=True, cache=True)
def channel_affine(x, scale, shift, out, act, a, b):
    """x[N, C, P] -> out: x * scale[c] + shift[c], then activation."""
    n_, c_, p_ = x.shape
    for nc in prange(n_ * c_):
        n = nc // c_
        c = nc % c_
        s = scale[c]
        t = shift[c]
        for p in range(p_):
            out[n, c, p] = act_scalar(x[n, c, p] * s + t, act, a, b)


@njit(parallel=True, cache=True)
def softmax3(x, out):
    """Softmax over axis 1 of x[outer, L, inner]."""
    o_, l_, i_ = x.shape
    for oi in prange(o_ * i_):
        o = oi // i_
        i = oi % i_
        m = -np.inf
        for k in range(l_):
            if x[o, k, i] > m:
                m = x[o, k, i]
        s = np.float32(0)
        for k in range(l_):
            e = np.exp(x[o, k, i] - m)
            out[o, k, i] = e
            s += e
        inv = np.float32(1) / s
        for k in range(l_):
            out[o, k, i] *= inv


@njit(parallel=True, cache=True)
def decode_i8(src, dst):
    """int8 weights -> float32 scratch (flat arrays); the scale is applied later."""
    for i in prange(src.size):
        dst[i] = np.float32(src[i])


@njit(parallel=True, cache=True)
def decode_f16(src, dst):
    """IEEE half (as uint16 bits) -> float32 (as uint32 bits), flat arrays.

    numba has no CPU float16 type, and NumPy's casting copy goes through a 32 KB
    buffer on every call; rebuilding the float32 bit pattern here does neither.
    """
    for i in prange(src.size):
        h = np.uint32(src[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        exp = (h >> np.uint32(10)) & np.uint32(0x1F)
        mant = h & np.uint32(0x3FF)
        if exp == 0:
            if mant == 0:
                dst[i] = sign
            else:  # subnormal half: renormalise into a normal float32
                e = np.uint32(113)  # 127 - 15 + 1
                while (mant & np.uint32(0x400)) == 0:
                    mant <<= np.uint32(1)
                    e -= np.uint32(1)
                dst[i] = sign | (e << np.uint32(23)) | ((mant & np.uint32(0x3FF)) << np.uint32(13))
        elif exp == 31:
            dst[i] = sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
        else:
            dst[i] = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))


@njit(inline="always")
def _binop(x, y, kind):
    if kind == 0:
        return x + y
    if kind == 1:
        return x - y
    if kind == 2:
        return x * y
    return x / y


@njit(parallel=True, cache=True)
def binary4(x, y, out, kind, act, a, b):
    """out = act(x (op) y) over 4-D views; x and y are broadcast views (zero strides)
    of out's shape. Elementwise at equal indices, so out may alias x or y (in place)."""
    d0, d1, d2, d3 = out.shape
    for ij in prange(d0 * d1):
        i = ij // d1
        j = ij % d1
        for k in range(d2):
            for m in range(d3):
                out[i, j, k, m] = act_scalar(_binop(x[i, j, k, m], y[i, j, k, m], kind), act, a, b)
