"""The int8 inverted-residual chain (``qmbconv``) in one parallel region, a band per thread.

Bound as three kernels a band (backend._bind_qmbconv before 2026-12-07), every band's
expansion, depthwise conv and projection were each split across the threads: three
pool launches a band, and the band's rows changed cores between the stages and at the
chain's ends, where the layers around it split the image in halves. On these VMs a
line one core wrote and the other reads costs 80-120 ns or 320-390 ns by where the
host put the two vCPUs (docs/cpu-kernels.md, "Two threads on these VMs").

Here worker ``sl`` takes a contiguous share of every image's output rows (the top
half at two threads, as the layers around it split) and runs it in bands through its
own slot of E (float32 expanded rows) and D (the depthwise conv's u8 codes): expand
the input rows the band's depthwise taps read (the halo rows of neighbouring bands
are expanded by both), depthwise into D, project D's codes, read in place, into the
band's output rows. The arithmetic is qgemm's and qdw's, called serially on the
band's views, so the output is the unfused nodes' to the bit (tests/test_kernels.py).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..flags import HAS_BIAS, HAS_RES
from .jit import njit
from .kernels import valid_cols
from .qdw import _qdw3_row
from .qgemm import MR, PANEL, _q8_block, code_bounds


@njit(inline="always")
def _rows_share(oh: int, workers: int, sl: int) -> tuple[int, int]:
    """Worker sl's contiguous share [lo, hi) of oh output rows (prange's static split)."""
    return oh * sl // workers, oh * (sl + 1) // workers


@njit(parallel=True, cache=True)
def qmbconv_rows(x, rtab, img, run4_e, we, ze, be, se, flags_e, act_e, a_e, b_e,
                 wd, bd, sd, flags_d, sh, sw, pt, pl, dh, dw, act_d, a_d, b_d, yinv_d, yz_d,
                 run4_p, wp, zp, y, bp, sp, res, flags_p, act_p, a_p, b_p, yinv_p, yz_p,
                 n_img, oh, ow, band, ebuf, dbuf, ptab, scratch):  # fmt: skip
    """y = project(depthwise(expand(x))) for n_img images, worker sl (scratch's rows) on
    its share of each image's oh output rows, in bands of at most ``band`` rows (module
    doc). x: the input's u8 codes, ``img`` bytes an image, pixel p of an image at byte
    rtab[p], ``run4_e`` * 4 bytes read a pixel (those past its channels meet zero
    weights); we .. b_e: the expansion's qgemm operands (float32 out); wd .. yz_d: the
    depthwise conv's (qdw.qdwconv3, into codes); run4_p .. yz_p: the projection's, with
    y[n_img * oh * ow, co] and res (HAS_RES in flags_p) by output pixel. ebuf[slots,
    E rows, W, CE] float32 and dbuf[slots, band * ow * CE + slack] u8: each worker's E
    and D; ptab[band * ow]: D's pixel offsets (k * CE); scratch[slots, MR + TILE / 2]
    int64: each worker's qgemm scratch."""
    workers = scratch.shape[0]
    wdt, ce = ebuf.shape[2], ebuf.shape[3]
    h = rtab.size // wdt
    te = (ce + PANEL - 1) // PANEL
    tp = (y.shape[1] + PANEL - 1) // PANEL
    lo_x, hi_x = valid_cols(-pl, sw, wdt - 2 * dw, ow)
    hi_x = max(hi_x, lo_x)
    has_bias_d = (flags_d & HAS_BIAS) != 0
    has_res = (flags_p & HAS_RES) != 0
    _, qlo_d, qhi_d = code_bounds(dbuf, act_d, a_d, b_d, yinv_d, yz_d)
    for sl in prange(workers):
        r_lo, r_hi = _rows_share(oh, workers, sl)
        if r_lo < r_hi:
            xo = scratch[sl, :MR]
            acc = scratch[sl, MR:].view(np.int32)
            e_sl, d_sl = ebuf[sl], dbuf[sl]
            nb = (r_hi - r_lo + band - 1) // band
            rb = (r_hi - r_lo + nb - 1) // nb  # even bands
            for n in range(n_img):
                xn = x[n * img :]
                for oy0 in range(r_lo, r_hi, rb):
                    r = min(rb, r_hi - oy0)
                    top = oy0 * sh - pt  # the band's first tap row, maybe above the image
                    lo = max(0, top)
                    hi = min(h, top + (r - 1) * sh + 2 * dh + 1)
                    e = e_sl[: hi - lo]
                    _q8_block(xn, rtab[lo * wdt : hi * wdt], run4_e, 1, 0, we, ze,
                              e.reshape(((hi - lo) * wdt, ce)), be, se, res, flags_e, act_e,
                              a_e, b_e, np.float32(1), np.float32(0), 0, te, 0, (hi - lo) * wdt,
                              xo, acc)  # fmt: skip
                    d = d_sl[: r * ow * ce].reshape((r, ow, ce))
                    for i in range(r):
                        _qdw3_row(e, wd, d, i, sh, sw, lo - top, pl, dh, dw, bd, sd, has_bias_d,
                                  lo_x, hi_x, qlo_d, qhi_d, np.float32(yinv_d), np.float32(yz_d))
                    m0 = (n * oh + oy0) * ow
                    _q8_block(d_sl, ptab, run4_p, 1, 0, wp, zp, y[m0 : m0 + r * ow], bp, sp,
                              res[m0 : m0 + r * ow] if has_res else res, flags_p, act_p, a_p,
                              b_p, yinv_p, yz_p, 0, tp, 0, r * ow, xo, acc)  # fmt: skip
