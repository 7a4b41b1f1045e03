"""Plain Python functions that both backends compile: numba ``njit`` in
kernels/cpu/llm.py, a ``cuda.jit`` device function in kernels/cuda/kernels.py. One
definition, so the two compute the same thing (the fp16 KV cache's bits, a norm's
row); only the loops around them differ (serial rows, grid-stride threads)."""

import math


def f32_bits_to_half(x):
    """The IEEE half nearest (ties to even) to the float32 with bits ``x``, as half bits
    (overflow to infinity, NaN kept quiet, gradual underflow): NumPy's cast."""
    x = x & 0xFFFFFFFF  # a wide signed integer from here on
    sign = (x >> 16) & 0x8000
    e = (x >> 23) & 0xFF
    m = x & 0x7FFFFF
    if e == 0xFF:
        return sign | 0x7C00 | (0x200 if m else 0)
    e16 = e - 112  # 127 - 15
    if e16 >= 31:
        return sign | 0x7C00
    if e16 <= 0:
        if e16 < -10:
            return sign
        m = m | 0x800000
        shift = 14 - e16
        hm = m >> shift
        rem = m & ((1 << shift) - 1)
        halfway = 1 << (shift - 1)
        if rem > halfway or (rem == halfway and (hm & 1)):
            hm += 1
        return sign | hm
    h = sign | (e16 << 10) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1)):
        h += 1  # a carry into the exponent is the right rounding (up to infinity)
    return h


def norm_row(x, w, b, y, r, eps, layer, has_b, group):
    """Row r of the ``norm`` op: each run of ``group`` columns of the first len(w),
    (x - mean) / sqrt(mean((x - mean)²) + eps) * w (+ b), mean 0 for RMSNorm; the
    columns past len(w) copied. Sums in float64 (x[r] float32 promotes against 0.0)."""
    n = w.shape[0]
    for c0 in range(0, n, group):
        # two sums, even and odd columns, then added: one chain of float64 adds waits on
        # their latency (a ViT's 17 x 64 LayerNorm: 5 us)
        c1 = c0 + group - group % 2
        mean = 0.0
        if layer:
            s, s2 = 0.0, 0.0
            for i in range(c0, c1, 2):
                s += x[r, i]
                s2 += x[r, i + 1]
            for i in range(c1, c0 + group):
                s += x[r, i]
            mean = (s + s2) / group
        ss, ss2 = 0.0, 0.0
        for i in range(c0, c1, 2):
            t = x[r, i] - mean
            t2 = x[r, i + 1] - mean
            ss += t * t
            ss2 += t2 * t2
        for i in range(c1, c0 + group):
            t = x[r, i] - mean
            ss += t * t
        inv = 1.0 / math.sqrt((ss + ss2) / group + eps)
        if has_b:
            for i in range(c0, c0 + group):
                y[r, i] = (x[r, i] - mean) * inv * w[i] + b[i]
        else:
            for i in range(c0, c0 + group):
                y[r, i] = (x[r, i] - mean) * inv * w[i]
    for i in range(n, x.shape[1]):
        y[r, i] = x[r, i]


# --- the math op (kernels/mathfns.py's codes) -------------------------------------------
# Written for numba's CPU and CUDA targets and for the CUDA simulator (plain Python):
# every domain edge is tested before the libm call, since Python's math raises where
# libm returns inf or NaN (log(0), exp(1000), floor(inf)). One function with no helper
# calls: numba compiles it per backend, and a plain-Python helper would not be.

_BIG = 4503599627370496.0  # 2**52: every float64 at least this large is an integer
_EXP_MAX = 709.782712893384  # log(largest float64)


def math_fn(code, v, a, b):
    """Function ``code`` of kernels/mathfns.py at v (float64), args a and b."""
    if code == 0:
        return abs(v)
    if code == 1:
        return -v
    if code == 2:
        return math.inf if v > _EXP_MAX else math.exp(v)
    if code == 3:
        if v > 0.0:
            return math.log(v) if v < math.inf else v
        return -math.inf if v == 0.0 else math.nan
    if code == 4:
        if v >= 0.0:
            return math.sqrt(v) if v < math.inf else v
        return math.nan
    if code == 5:
        if v == 0.0:
            return math.copysign(math.inf, v)
        return 1.0 / v
    if code == 6 or code == 7:  # NaN fails the test and comes back as is, as do infinities
        if not abs(v) < _BIG:
            return v
        return float(math.floor(v)) if code == 6 else -float(math.floor(-v))
    if code == 8:  # halves to even
        if not abs(v) < _BIG:
            return v
        f = float(math.floor(v))
        d = v - f
        if d > 0.5 or (d == 0.5 and f - 2.0 * float(math.floor(f / 2.0)) == 1.0):
            f += 1.0
        return f
    if code == 9:
        if v > 0.0:
            return 1.0
        if v < 0.0:
            return -1.0
        return v  # 0 or NaN
    if code <= 12:
        if not abs(v) < math.inf:
            return math.nan  # sin, cos, tan of an infinity (or NaN)
        if code == 10:
            return math.sin(v)
        if code == 11:
            return math.cos(v)
        return math.tan(v)
    if code == 13:
        return math.asin(v) if abs(v) <= 1.0 else math.nan
    if code == 14:
        return math.acos(v) if abs(v) <= 1.0 else math.nan
    if code == 15:
        return math.atan(v)
    if code == 16:
        if abs(v) > _EXP_MAX:
            return math.copysign(math.inf, v)
        return math.sinh(v)
    if code == 17:
        if abs(v) > _EXP_MAX:
            return math.inf
        return math.cosh(v)
    if code == 18:
        return math.asinh(v) if abs(v) < math.inf else v
    if code == 19:
        if v >= 1.0:
            return math.acosh(v) if v < math.inf else v
        return math.nan
    if code == 20:
        if abs(v) < 1.0:
            return math.atanh(v)
        if abs(v) == 1.0:
            return math.copysign(math.inf, v)
        return math.nan
    if code == 21 or code == 29:
        if v != v:
            return v
        if code == 21:
            return math.erf(v)
        return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))
    if code == 22 or code == 27:  # softplus, and mish = v * tanh(softplus(v))
        if v != v:
            return v
        sp = max(v, 0.0) + math.log1p(math.exp(-abs(v)))
        return sp if code == 22 else v * math.tanh(sp)
    if code == 23:
        return v / (1.0 + abs(v))
    if code == 24:
        return a * math.expm1(v) if v < 0.0 else v
    if code == 25:
        return b * (a * math.exp(v) - a) if v <= 0.0 else b * v
    if code == 26:
        if v != v:
            return v
        return max(v, 0.0) + min(0.0, a * math.expm1(v / a)) if v < 0.0 else v
    if code == 28:  # NaN fails the comparison: 0, as ONNX Runtime
        return v if v > a else 0.0
    if code == 30:
        return 0.5 * v * (1.0 + math.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    # 31: shrink (a = bias, b = lambd)
    if v < -b:
        return v + a
    if v > b:
        return v - a
    return 0.0
