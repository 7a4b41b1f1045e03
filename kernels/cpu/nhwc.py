"""Channels-last (NHWC) numba CPU kernels: depthwise conv, max pool, global average pool.

Arguments are per image and C-contiguous: x[H, W, C], out[OH, OW, C]. The channel
axis is the contiguous one, so every inner loop runs over channels with unit stride
and LLVM vectorises it whatever the stride or dilation of the window (the planar
kernels need de-interleaving planes at stride 2). As in kernels/cpu/kernels.py there is no
``fastmath``: channels are independent, so nothing is reassociated and the results do
not depend on the vector width.

Each output row is split into the left border, the interior (every tap inside the
image: no per-tap tests) and the right border. A 3x3 window over the interior sums its
nine taps in registers, in the same order as the planar ``dwconv``, and applies the
epilogue (scale, bias, clamp) before the one store; a residual is added, with the
clamp, in a pass over each finished row (add_clamp_row). Border pixels and other
windows sum the taps inside the image in a vector register, eight channels at a time
(simd.Ops), and take the same epilogue before their one store; a nine-tap border path
that read clamped positions and zeroed them with selects measured no faster, at 7x7
slower.

ReLU and clip are fused as a clamp written as compare-selects (vector max / min); a
NaN passes through them, and ReLU keeps the sign of a zero (planar act_scalar maps
both to +0). Other activations run as a pass over each finished row (act_row).

The row loops live in plain helper functions, one call per row segment: a call per
pixel passes every array as a struct of seven fields and cost more than the pixel at
32 channels. The epilogue variant is tested once per segment, outside the loops; a
test inside the channel loop would keep LLVM from vectorising it. Flat indices are
built in int64 and cast to ``np.uintp`` at the subscript, so numba emits no
negative-index wrap-around.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..flags import HAS_BIAS, HAS_RES, HAS_SCALE
from .jit import njit
from .kernels import act_row, valid_cols
from .simd import Ops

_INF = np.float32(np.inf)
_V8 = Ops(8)  # eight lanes on every CPU, as llm.py
vload, vload_n, vstore, vstore_n = _V8.vload, _V8.vload_n, _V8.vstore, _V8.vstore_n
vloadw, vloadw_n = _V8.vloadw, _V8.vloadw_n
vsplat, vzero, vfma, vadd, vmul = _V8.vsplat, _V8.vzero, _V8.vfma, _V8.vadd, _V8.vmul
vmin, vmax = _V8.vmin, _V8.vmax
_DWK_BLOCK = 8  # output pixels a block (dw3's DWB)


@njit(forceinline=True)
def _clamp(v, lo, hi):
    """min(max(v, lo), hi) as compare-selects that LLVM turns into vector max / min;
    a NaN passes through."""
    v = lo if v < lo else v
    return hi if v > hi else v


@njit(forceinline=True)
def clamp_bounds(act, a, b):
    """(lo, hi) of the fused clamp: relu and clip; +-inf (no-op) for the others,
    which then run as a pass over the row (act_row)."""
    if act == 1:
        return np.float32(0), _INF
    if act == 3:
        return np.float32(a), np.float32(b)
    return -_INF, _INF


@njit(forceinline=True)
def _sum9(xf, wf, p0, p1, p2, cs, n_c, c):
    """The nine taps of channel c: input rows at flat p0, p1, p2 (column taps cs
    apart), weights wf[(3 i + j) * C + c] widened to float32; the planar dwconv's order."""
    w00 = np.float32(wf[np.uintp(c)])
    w01 = np.float32(wf[np.uintp(n_c + c)])
    w02 = np.float32(wf[np.uintp(2 * n_c + c)])
    w10 = np.float32(wf[np.uintp(3 * n_c + c)])
    w11 = np.float32(wf[np.uintp(4 * n_c + c)])
    w12 = np.float32(wf[np.uintp(5 * n_c + c)])
    w20 = np.float32(wf[np.uintp(6 * n_c + c)])
    w21 = np.float32(wf[np.uintp(7 * n_c + c)])
    w22 = np.float32(wf[np.uintp(8 * n_c + c)])
    return (
        (
            w00 * xf[np.uintp(p0 + c)]
            + w01 * xf[np.uintp(p0 + cs + c)]
            + w02 * xf[np.uintp(p0 + 2 * cs + c)]
        )
        + (
            w10 * xf[np.uintp(p1 + c)]
            + w11 * xf[np.uintp(p1 + cs + c)]
            + w12 * xf[np.uintp(p1 + 2 * cs + c)]
        )
        + (
            w20 * xf[np.uintp(p2 + c)]
            + w21 * xf[np.uintp(p2 + cs + c)]
            + w22 * xf[np.uintp(p2 + 2 * cs + c)]
        )
    )


def _make_row9(fixed_c: int):
    """_row9 for any channel count (``fixed_c`` 0), or one compiled for exactly
    ``fixed_c`` channels at dilation 1: the tap offsets are then constants, and a
    pixel's taps address off three row pointers instead of eighteen (25% at 32
    channels, where a pixel is only four vectors)."""

    @njit
    def row9(of, xf, wf, bias, scale, orow, xrow, ox0, ox1, step, rs, cs_, n_c_, ep, lo, hi):
        """Output pixels [ox0, ox1) of one row of a 3x3 window whose taps are all inside:
        out[orow + ox * C + c] = clamp(epilogue(sum)), the input window of pixel ox at flat
        xrow + ox * step (rows rs apart, columns cs apart). ``ep`` holds the bias and
        scale bits (a residual is dwconv_nhwc's pass after the row)."""
        n_c = fixed_c if fixed_c else n_c_
        cs = fixed_c if fixed_c else cs_
        if ep == HAS_BIAS:
            for ox in range(ox0, ox1):
                p0, o = xrow + ox * step, orow + ox * n_c
                for c in range(n_c):
                    v = _sum9(xf, wf, p0, p0 + rs, p0 + 2 * rs, cs, n_c, c) + bias[np.uintp(c)]
                    of[np.uintp(o + c)] = _clamp(v, lo, hi)
        elif ep == HAS_BIAS | HAS_SCALE:
            for ox in range(ox0, ox1):
                p0, o = xrow + ox * step, orow + ox * n_c
                for c in range(n_c):
                    v = _sum9(xf, wf, p0, p0 + rs, p0 + 2 * rs, cs, n_c, c) * scale[np.uintp(c)]
                    v += bias[np.uintp(c)]
                    of[np.uintp(o + c)] = _clamp(v, lo, hi)
        elif ep == 0:
            for ox in range(ox0, ox1):
                p0, o = xrow + ox * step, orow + ox * n_c
                for c in range(n_c):
                    v = _sum9(xf, wf, p0, p0 + rs, p0 + 2 * rs, cs, n_c, c)
                    of[np.uintp(o + c)] = _clamp(v, lo, hi)
        else:  # HAS_SCALE
            for ox in range(ox0, ox1):
                p0, o = xrow + ox * step, orow + ox * n_c
                for c in range(n_c):
                    v = _sum9(xf, wf, p0, p0 + rs, p0 + 2 * rs, cs, n_c, c) * scale[np.uintp(c)]
                    of[np.uintp(o + c)] = _clamp(v, lo, hi)

    return row9


_row9 = _make_row9(0)
_row9_16 = _make_row9(16)
_row9_32 = _make_row9(32)


@njit(inline="always")
def _px_out(of, o, acc, sv, bv, vlo, vhi, nl):
    acc = vmin(vmax(vadd(vmul(acc, sv), bv), vlo), vhi)
    if nl >= 8:  # a masked store is microcoded on AMD (vmaskmovps)
        vstore(of, o, acc)
    else:
        vstore_n(of, o, acc, nl)


@njit
def add_clamp_row(row, res, lo, hi):
    """row = clamp(row + res) in place: a depthwise conv's residual as a pass of its own
    over each finished output row. Tested inside the vector kernels' pixel loops (a
    masked load under the test) it kept LLVM from keeping their sums in registers and
    cost 3x even without a residual (a 5x5 conv of 2x96x200: 75 us against 24)."""
    for i in range(row.size):
        row[i] = _clamp(row[i] + res[i], lo, hi)


@njit(inline="always")
def _xtap(xf, q, full, nl):
    return vload(xf, q) if full else vload_n(xf, q, nl)


@njit(inline="always")
def _wtap(wf, t, full, nl):
    return vloadw(wf, t) if full else vloadw_n(wf, t, nl)


@njit
def _row_edge(
    of, xf, wf, bias, scale, orow, iy0, ox0, ox1, h, wd, kh, kw, sw, pl, dh, dw, n_c, ep,
    lo, hi,
):  # fmt: skip
    """Output pixels [ox0, ox1) whose window may overlap the padding (or any pixel of a
    window other than 3x3), epilogue included: per block of pixels and vector of eight
    channels, the taps inside the image summed in registers in tap order, then scale,
    bias, residual and clamp, one store. Four pixels whose windows fit the row's width
    go together, four fma chains sharing each weight load: one chain is bound by the fma
    latency (4 cycles a tap on Zen 3). Accumulating in the pixel in memory, a load and a
    store a tap, had run MobileNetV3's 5x5 depthwise convs (OCR's text-direction
    classifier: 0.50 of its 1.43 ms) at about a third of this."""
    i_lo, i_hi = 0, 0  # kernel rows inside the image
    for i in range(kh):
        iy = iy0 + i * dh
        if iy >= 0 and iy < h:
            if i_hi == 0:
                i_lo = i
            i_hi = i + 1
    geo = (orow, iy0, ox0, ox1, wd, kw, sw, pl, dh, dw, n_c, i_lo, i_hi)
    _edge_px(of, xf, wf, bias, scale, geo, ep, lo, hi)


@njit(inline="always")
def _edge_px(of, xf, wf, bias, scale, geo, ep, lo, hi):
    orow, iy0, ox0, ox1, wd, kw, sw, pl, dh, dw, n_c, i_lo, i_hi = geo
    one, zero = vsplat(np.float32(1)), vzero()
    vlo, vhi = vsplat(lo), vsplat(hi)
    has_scale, has_bias = ep & HAS_SCALE, ep & HAS_BIAS
    cs, step = dw * n_c, sw * n_c
    span = (kw - 1) * dw  # a window's width less one
    for xb in range(ox0, ox1, _DWK_BLOCK):  # a block's input stays in L1 across channels
        xe = min(xb + _DWK_BLOCK, ox1)
        for c0 in range(0, n_c, 8):
            nl = n_c - c0
            full = nl >= 8
            sv = vload_n(scale, c0, nl) if has_scale else one
            bv = vload_n(bias, c0, nl) if has_bias else zero
            ox = xb
            while ox < xe:
                ix0 = ox * sw - pl
                o = orow + ox * n_c + c0
                if ox + 4 <= xe and ix0 >= 0 and ix0 + 3 * sw + span < wd:
                    a0, a1, a2, a3 = zero, zero, zero, zero
                    for i in range(i_lo, i_hi):
                        p = ((iy0 + i * dh) * wd + ix0) * n_c + c0
                        t = i * kw * n_c + c0
                        for j in range(kw):
                            wv = _wtap(wf, t + j * n_c, full, nl)
                            q = p + j * cs
                            a0 = vfma(wv, _xtap(xf, q, full, nl), a0)
                            a1 = vfma(wv, _xtap(xf, q + step, full, nl), a1)
                            a2 = vfma(wv, _xtap(xf, q + 2 * step, full, nl), a2)
                            a3 = vfma(wv, _xtap(xf, q + 3 * step, full, nl), a3)
                    _px_out(of, o, a0, sv, bv, vlo, vhi, nl)
                    _px_out(of, o + n_c, a1, sv, bv, vlo, vhi, nl)
                    _px_out(of, o + 2 * n_c, a2, sv, bv, vlo, vhi, nl)
                    _px_out(of, o + 3 * n_c, a3, sv, bv, vlo, vhi, nl)
                    ox += 4
                else:
                    j_lo = 0 if ix0 >= 0 else (-ix0 + dw - 1) // dw
                    j_hi = min(kw, (wd - 1 - ix0) // dw + 1) if ix0 < wd else 0
                    acc = zero
                    for i in range(i_lo, i_hi):
                        p = ((iy0 + i * dh) * wd + ix0) * n_c + c0
                        t = i * kw * n_c + c0
                        for j in range(j_lo, j_hi):
                            acc = vfma(_wtap(wf, t + j * n_c, full, nl),
                                       _xtap(xf, p + j * cs, full, nl), acc)  # fmt: skip
                    _px_out(of, o, acc, sv, bv, vlo, vhi, nl)
                    ox += 1


@njit(parallel=True, cache=True)
def dwconv_nhwc(x, w, bias, scale, res, out, sh, sw, pt, pl, dh, dw, flags, act, a, b):
    """Depthwise conv, one image, channels-last: x[H, W, C], w[kh, kw, 1, C] (float32
    or int8, widened here), bias[C], scale[C], res[OH, OW, C] (a (1, 1, 1) dummy without
    HAS_RES), out[OH, OW, C] = act(scale * sum + bias [+ res]). Rows run in parallel."""
    h, wd, n_c = x.shape
    kh, kw = w.shape[0], w.shape[1]
    oh, ow = out.shape[0], out.shape[1]
    xf = x.reshape(x.size)
    wf = w.reshape(w.size)
    of = out.reshape(out.size)
    rf = res.reshape(res.size)
    has_res = (flags & HAS_RES) != 0
    ep = flags & (HAS_BIAS | HAS_SCALE)  # the residual: add_clamp_row after each row
    lo_a, hi_a = clamp_bounds(act, a, b)
    lo, hi = (-_INF, _INF) if has_res else (lo_a, hi_a)  # then the clamp there
    post = act != 0 and act != 1 and act != 3  # activations not fused as a clamp
    # output columns whose whole window is inside the image
    lo_x, hi_x = valid_cols(-pl, sw, wd - (kw - 1) * dw, ow)
    hi_x = max(hi_x, lo_x)
    k3 = kh == 3 and kw == 3
    fixed = n_c if dw == 1 and (n_c == 16 or n_c == 32) else 0  # _make_row9
    for oy in prange(oh):
        iy0 = oy * sh - pt
        orow = oy * ow * n_c
        if k3 and iy0 >= 0 and iy0 + 2 * dh < h:
            _row_edge(
                of, xf, wf, bias, scale, orow, iy0, 0, lo_x, h, wd, kh, kw, sw, pl, dh, dw,
                n_c, ep, lo, hi,
            )  # fmt: skip
            xrow = (iy0 * wd - pl) * n_c
            if fixed == 16:
                _row9_16(
                    of, xf, wf, bias, scale, orow, xrow, lo_x, hi_x, sw * n_c, dh * wd * n_c,
                    dw * n_c, n_c, ep, lo, hi,
                )  # fmt: skip
            elif fixed == 32:
                _row9_32(
                    of, xf, wf, bias, scale, orow, xrow, lo_x, hi_x, sw * n_c, dh * wd * n_c,
                    dw * n_c, n_c, ep, lo, hi,
                )  # fmt: skip
            else:
                _row9(
                    of, xf, wf, bias, scale, orow, xrow, lo_x, hi_x, sw * n_c, dh * wd * n_c,
                    dw * n_c, n_c, ep, lo, hi,
                )  # fmt: skip
            _row_edge(
                of, xf, wf, bias, scale, orow, iy0, hi_x, ow, h, wd, kh, kw, sw, pl, dh, dw,
                n_c, ep, lo, hi,
            )  # fmt: skip
        else:
            _row_edge(
                of, xf, wf, bias, scale, orow, iy0, 0, ow, h, wd, kh, kw, sw, pl, dh, dw,
                n_c, ep, lo, hi,
            )  # fmt: skip
        if has_res:
            add_clamp_row(of[orow : orow + ow * n_c], rf[orow : orow + ow * n_c], lo_a, hi_a)
        if post:
            act_row(of[orow : orow + ow * n_c], act, a, b)


@njit
def _mrow9(of, xf, orow, xrow, ox0, ox1, step, rs, cs, n_c):
    """Max pool counterpart of _row9 (no epilogue). Compare-selects that skip NaN, in
    the planar maxpool's tap order."""
    for ox in range(ox0, ox1):
        p0, o = xrow + ox * step, orow + ox * n_c
        p1, p2 = p0 + rs, p0 + 2 * rs
        for c in range(n_c):
            m = -_INF
            for p in (p0, p1, p2):
                v0 = xf[np.uintp(p + c)]
                v1 = xf[np.uintp(p + cs + c)]
                v2 = xf[np.uintp(p + 2 * cs + c)]
                m = v0 if v0 > m or v0 != v0 else m
                m = v1 if v1 > m or v1 != v1 else m
                m = v2 if v2 > m or v2 != v2 else m
            of[np.uintp(o + c)] = m


@njit
def _mrow_any(of, xf, orow, iy0, ox0, ox1, h, wd, kh, kw, sw, pl, dh, dw, n_c):
    """Max pool counterpart of _row_any: taps tested, folded into the pixel."""
    for ox in range(ox0, ox1):
        o = orow + ox * n_c
        ix0 = ox * sw - pl
        for c in range(n_c):
            of[np.uintp(o + c)] = -_INF
        for i in range(kh):
            iy = iy0 + i * dh
            if iy < 0 or iy >= h:
                continue
            for j in range(kw):
                ix = ix0 + j * dw
                if ix < 0 or ix >= wd:
                    continue
                p = (iy * wd + ix) * n_c
                for c in range(n_c):
                    v = xf[np.uintp(p + c)]
                    m = of[np.uintp(o + c)]
                    of[np.uintp(o + c)] = v if v > m or v != v else m


@njit(parallel=True, cache=True)
def maxpool_nhwc(x, out, kh, kw, sh, sw, pt, pl, dh, dw):
    """x[H, W, C] -> out[OH, OW, C]; padding never wins (it is -inf in ONNX). A 3x3
    window over the interior takes its nine taps in registers; other pixels and
    windows fold tap by tap into the output pixel. Rows run in parallel."""
    h, wd, n_c = x.shape
    oh, ow = out.shape[0], out.shape[1]
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    lo_x, hi_x = valid_cols(-pl, sw, wd - (kw - 1) * dw, ow)
    hi_x = max(hi_x, lo_x)
    k3 = kh == 3 and kw == 3
    for oy in prange(oh):
        iy0 = oy * sh - pt
        orow = oy * ow * n_c
        if k3 and iy0 >= 0 and iy0 + 2 * dh < h:
            _mrow_any(of, xf, orow, iy0, 0, lo_x, h, wd, kh, kw, sw, pl, dh, dw, n_c)
            _mrow9(
                of, xf, orow, (iy0 * wd - pl) * n_c, lo_x, hi_x, sw * n_c, dh * wd * n_c,
                dw * n_c, n_c,
            )  # fmt: skip
            _mrow_any(of, xf, orow, iy0, hi_x, ow, h, wd, kh, kw, sw, pl, dh, dw, n_c)
        else:
            _mrow_any(of, xf, orow, iy0, 0, ow, h, wd, kh, kw, sw, pl, dh, dw, n_c)


GAP_BLOCK = 128  # channels per parallel task of global_avgpool_nhwc


@njit(parallel=True, cache=True)
def global_avgpool_nhwc(x, out):
    """x[P, C] (the H * W pixels of one image) -> out[C]: the mean over pixels.

    Each channel is summed over the pixels in order, as the planar global_avgpool
    does, so both layouts give the same bits; the running sums live in ``out``."""
    p_, n_c = x.shape
    xf = x.reshape(x.size)
    for blk in prange((n_c + GAP_BLOCK - 1) // GAP_BLOCK):
        c0 = blk * GAP_BLOCK
        c1 = min(c0 + GAP_BLOCK, n_c)
        for c in range(c0, c1):
            out[np.uintp(c)] = 0.0
        for p in range(p_):
            base = p * n_c
            for c in range(c0, c1):
                out[np.uintp(c)] += xf[np.uintp(base + c)]
        for c in range(c0, c1):
            out[np.uintp(c)] = out[np.uintp(c)] / p_


@njit(parallel=True, cache=True)
def pad_nhwc(x, xp, pt, pl):
    """xp[Hp, Wp, C] = x[H, W, C] placed at row pt, column pl, zeros around it. Rows
    and columns of x past xp's edge are left out: a strided conv never reads them. The
    channels-last conv reads its taps in place from xp (backend_cpu)."""
    h, wd, n_c = x.shape
    hp, wp = xp.shape[0], xp.shape[1]
    xf = x.reshape(x.size)
    pf = xp.reshape(xp.size)
    n = max(0, min(wd, wp - pl))  # columns of x that land in xp
    for r in prange(hp):
        iy = r - pt
        o = r * wp * n_c
        if iy < 0 or iy >= h:
            for q in range(wp * n_c):
                pf[np.uintp(o + q)] = 0.0
            continue
        for q in range(pl * n_c):
            pf[np.uintp(o + q)] = 0.0
        s0 = iy * wd * n_c
        d0 = o + pl * n_c
        for q in range(n * n_c):
            pf[np.uintp(d0 + q)] = xf[np.uintp(s0 + q)]
        for q in range((pl + n) * n_c, wp * n_c):
            pf[np.uintp(o + q)] = 0.0
