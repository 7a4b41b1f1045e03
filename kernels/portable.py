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
        mean = 0.0
        if layer:
            s = 0.0
            for i in range(c0, c0 + group):
                s += x[r, i]
            mean = s / group
        ss = 0.0
        for i in range(c0, c0 + group):
            t = x[r, i] - mean
            ss += t * t
        inv = 1.0 / math.sqrt(ss / group + eps)
        for i in range(c0, c0 + group):
            v = (x[r, i] - mean) * inv * w[i]
            if has_b:
                v += b[i]
            y[r, i] = v
    for i in range(n, x.shape[1]):
        y[r, i] = x[r, i]
