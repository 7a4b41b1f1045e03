"""3x3 depthwise conv whose output is the u8 codes of the int8 conv that reads it.

Between an int8 expansion conv and an int8 projection conv (MobileNet's inverted
residual) the depthwise conv's output is read only by the projection, which quantizes
it to u8 first: written as float32, read back, quantized into a copy. Written as its
codes it is a quarter of the bytes and the projection reads it in place (MobileNetV2's
56x56x144 block: the projection's pass over its input took 0.10 of its 0.20 ms).

The arithmetic is gemm_tiles.dw3's: float32 input, the weights widened to float32
(float32, or int8 with their per-channel scale in ``scale``), nine fmas per output
vector with the nine weights in registers, then scale, bias and the requantization,
with relu or clip as bounds on the codes (qgemm.vstore_out, code_bounds). Codes in were
tried too (the expansion writing codes): converting u8 to float32 costs two more
instructions a tap than an fma from memory, and MobileNetV2 at 1 thread took 5.2 ms
against 4.7 (only the 112x112 stride-2 depthwise conv gained, 0.32 -> 0.24 ms; the
expansions' u8 stores and the stride-1 depthwise convs lost more).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..flags import HAS_BIAS
from .jit import njit
from .kernels import valid_cols
from .qgemm import LANES, code_bounds, vstore_out
from .simd import Ops

_V = Ops(LANES)
vloadw_n, vload_n, vload, vfma, vmul, vadd = (
    _V.vloadw_n, _V.vload_n, _V.vload, _V.vfma, _V.vmul, _V.vadd,
)  # fmt: skip
vzero = _V.vzero


@njit(cache=True)
def _qdw3_row(x, w, out, oy, sh, sw, pt, pl, dh, dw, bias, scale, has_bias, lo_x, hi_x,
              qlo, qhi, yinv, yz):  # fmt: skip
    """Output row oy: per vector of channels the edge pixels (a tap outside the image
    loads with an empty mask: zeros, nothing read), then the interior, the nine weights
    in registers for both; relu or clip applied to the codes (qgemm.code_bounds)."""
    h, wd, n_c = x.shape
    ow = out.shape[1]
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    rs = dh * wd * n_c
    cs = dw * n_c
    step = sw * n_c
    iy0 = oy * sh - pt
    r0 = iy0 >= 0 and iy0 < h
    r1 = iy0 + dh >= 0 and iy0 + dh < h
    r2 = iy0 + 2 * dh >= 0 and iy0 + 2 * dh < h
    i_lo, i_hi = (lo_x, hi_x) if r0 and r1 and r2 else (0, 0)
    orow = oy * ow * n_c
    zero = vzero()
    for c0 in range(0, n_c, LANES):
        nl = n_c - c0
        w0 = vloadw_n(w, 0 * n_c + c0, nl)
        w1 = vloadw_n(w, 1 * n_c + c0, nl)
        w2 = vloadw_n(w, 2 * n_c + c0, nl)
        w3 = vloadw_n(w, 3 * n_c + c0, nl)
        w4 = vloadw_n(w, 4 * n_c + c0, nl)
        w5 = vloadw_n(w, 5 * n_c + c0, nl)
        w6 = vloadw_n(w, 6 * n_c + c0, nl)
        w7 = vloadw_n(w, 7 * n_c + c0, nl)
        w8 = vloadw_n(w, 8 * n_c + c0, nl)
        sv = vload_n(scale, c0, nl)
        bv = vload_n(bias, c0, nl) if has_bias else zero
        n0, n1, n2 = (nl if r0 else 0), (nl if r1 else 0), (nl if r2 else 0)
        for k in range(i_lo + ow - i_hi):  # the edge pixels: left of i_lo, then from i_hi
            ox = k if k < i_lo else i_hi + k - i_lo
            ix0 = ox * sw - pl
            m0 = ix0 >= 0 and ix0 < wd
            m1 = ix0 + dw >= 0 and ix0 + dw < wd
            m2 = ix0 + 2 * dw >= 0 and ix0 + 2 * dw < wd
            p0 = (iy0 * wd + ix0) * n_c + c0
            p1 = p0 + rs
            p2 = p1 + rs
            acc = zero
            acc = vfma(w0, vload_n(xf, p0, n0 if m0 else 0), acc)
            acc = vfma(w1, vload_n(xf, p0 + 1 * cs, n0 if m1 else 0), acc)
            acc = vfma(w2, vload_n(xf, p0 + 2 * cs, n0 if m2 else 0), acc)
            acc = vfma(w3, vload_n(xf, p1, n1 if m0 else 0), acc)
            acc = vfma(w4, vload_n(xf, p1 + 1 * cs, n1 if m1 else 0), acc)
            acc = vfma(w5, vload_n(xf, p1 + 2 * cs, n1 if m2 else 0), acc)
            acc = vfma(w6, vload_n(xf, p2, n2 if m0 else 0), acc)
            acc = vfma(w7, vload_n(xf, p2 + 1 * cs, n2 if m1 else 0), acc)
            acc = vfma(w8, vload_n(xf, p2 + 2 * cs, n2 if m2 else 0), acc)
            y = vadd(vmul(acc, sv), bv)
            vstore_out(of, orow + ox * n_c + c0, y, nl, yinv, yz, qlo, qhi)
        if i_lo >= i_hi or nl < LANES:
            # a partial vector of channels: the edge form (masked loads) for every pixel
            for ox in range(i_lo, i_hi):
                p0 = (iy0 * wd + ox * sw - pl) * n_c + c0
                p1 = p0 + rs
                p2 = p1 + rs
                acc = zero
                acc = vfma(w0, vload_n(xf, p0, nl), acc)
                acc = vfma(w1, vload_n(xf, p0 + 1 * cs, nl), acc)
                acc = vfma(w2, vload_n(xf, p0 + 2 * cs, nl), acc)
                acc = vfma(w3, vload_n(xf, p1, nl), acc)
                acc = vfma(w4, vload_n(xf, p1 + 1 * cs, nl), acc)
                acc = vfma(w5, vload_n(xf, p1 + 2 * cs, nl), acc)
                acc = vfma(w6, vload_n(xf, p2, nl), acc)
                acc = vfma(w7, vload_n(xf, p2 + 1 * cs, nl), acc)
                acc = vfma(w8, vload_n(xf, p2 + 2 * cs, nl), acc)
                y = vadd(vmul(acc, sv), bv)
                vstore_out(of, orow + ox * n_c + c0, y, nl, yinv, yz, qlo, qhi)
            continue
        p0 = (iy0 * wd + i_lo * sw - pl) * n_c + c0
        o = orow + i_lo * n_c + c0
        for _ in range(i_lo, i_hi):
            p1 = p0 + rs
            p2 = p1 + rs
            acc = zero
            acc = vfma(w0, vload(xf, p0), acc)
            acc = vfma(w1, vload(xf, p0 + 1 * cs), acc)
            acc = vfma(w2, vload(xf, p0 + 2 * cs), acc)
            acc = vfma(w3, vload(xf, p1), acc)
            acc = vfma(w4, vload(xf, p1 + 1 * cs), acc)
            acc = vfma(w5, vload(xf, p1 + 2 * cs), acc)
            acc = vfma(w6, vload(xf, p2), acc)
            acc = vfma(w7, vload(xf, p2 + 1 * cs), acc)
            acc = vfma(w8, vload(xf, p2 + 2 * cs), acc)
            y = vadd(vmul(acc, sv), bv)
            vstore_out(of, o, y, LANES, yinv, yz, qlo, qhi)
            p0 += step
            o += n_c


@njit(parallel=True, cache=True)
def qdwconv3(x, w, bias, scale, out, sh, sw, pt, pl, dh, dw, flags, act, a, b, yinv, yz):
    """3x3 depthwise conv, one image, channels-last, into u8 codes (module doc): x[H, W, C]
    float32, w[3, 3, 1, C] float32 or int8, scale[C] (the weights'; ones for float32),
    bias[C] (HAS_BIAS), out[OH, OW, C] u8 codes of scale 1 / yinv and zero point yz;
    act none, relu or clip. Rows run in parallel."""
    wd = x.shape[1]
    oh, ow = out.shape[0], out.shape[1]
    _, qlo, qhi = code_bounds(out, act, a, b, yinv, yz)  # relu, clip: on the codes
    lo_x, hi_x = valid_cols(-pl, sw, wd - 2 * dw, ow)  # windows inside the row
    hi_x = max(hi_x, lo_x)
    has_bias = (flags & HAS_BIAS) != 0
    for oy in prange(oh):
        _qdw3_row(x, w, out, oy, sh, sw, pt, pl, dh, dw, bias, scale, has_bias, lo_x, hi_x,
                  qlo, qhi, np.float32(yinv), np.float32(yz))  # fmt: skip
