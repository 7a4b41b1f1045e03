"""The CPU backend: numba kernels plus NumPy calls that write into arena views.

Conv products run on the register-tiled GEMM of gemm_tiles.py, which applies the
conv epilogue (scale, bias, residual, activation) in its tiles and writes straight into
the planned arena slot; Winograd convs run gemm_tiles' channels-last transforms and
their a*a products on the same micro-kernel. Linear layers go to NumPy's BLAS
(``np.matmul(..., out=view)``), which is faster on those shapes (docs/cpu-kernels.md).
Everything else (im2col, weight decode, depthwise conv, pooling, int8 GEMV) is numba.
Nothing here allocates per call: scratch comes from the arena.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import generic as G
from .. import layout, mbconv, winograd, wtypes
from ..binding import act_args as _act
from ..binding import epilogue_flags as _flags
from ..binding import nbytes as _nbytes
from ..binding import up64
from ..decoded import decoded
from ..flags import PER_COL
from ..layout import PANEL
from ..mathfns import math_code
from ..ops import BINARY_KINDS, GATE_ACTS, norm_group, slice_block
from ..ops import args as _args
from ..recurrent import rnn_scratch_floats, rnn_step
from ..registry import Bound, Kernel, Spec, register
from .abi import (
    GEMM_XP_FLOATS,
    GEMMP_SLAB_FLOATS,
    MBCONV_ROWS_TYPES,
    QGEMM_SLACK,
    XQ_BLOCK,
    qgemm_scratch_int64s,
    xq_scratch_layout,
    xq_scratch_views,
)
from .native import K, kernel_threads, resolved
from .pool import lend_cores

F32 = np.dtype(np.float32)
# An absent bias or scale, read-only like the bundle's own: one more array type per
# kernel argument is one more compile of the kernel and of every tile it calls.
_DUMMY1 = np.zeros(1, np.float32)
_DUMMY1.flags.writeable = False
_DUMMY2 = np.zeros((1, 1), np.float32)
_DUMMY3 = np.zeros((1, 1, 1), np.float32)
_EMPTY_E = np.zeros((1, 1, 1, 1), np.float32)  # mbconv_rows' E slots without an expand conv
_NOSLABS = np.zeros((1, 1), np.float32)  # gemmp's slab buffers for float32 panels: none
_NOSLABS.flags.writeable = False
# Half-precision weights as the kernels take them: their bits (numba has no CPU float16;
# simd's _widen tells fp16 from bf16 by the bits' integer type).
HALF_BITS = {"f16": np.uint16, "bf16": np.int16}
_NOROWS = np.zeros(1, np.int64)  # gemmp's row table of evenly strided rows
_NOROWS.flags.writeable = False


def _f32_slot(scratch: np.ndarray, offset: int, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    n = int(np.prod(shape)) * 4
    return scratch[offset : offset + n].view(np.float32).reshape(shape), offset + n


# Weight types the depthwise kernels read in place (int8 widened in
# registers); every other non-float32 weight is widened into scratch first.
_READ_IN_PLACE = ("f32", "i8")


def _decoder(w: np.ndarray, dst: np.ndarray):
    """A step that widens weights of a type their numpy dtype names (int8, fp16, bf16)
    into the float32 scratch ``dst``, with the decoder the weight-type table names."""
    row = wtypes.get(wtypes.of_array(w))
    kern = getattr(K, row.decoders["cpu"])
    src, out = w.reshape(-1), dst.reshape(-1)
    if row.storage.itemsize == 2:  # half formats: bit patterns in; bf16's out as bits
        src = src.view(np.uint16)
        out = out if row.name == "f16" else out.view(np.uint32)
    return lambda: kern(src, out)


def _weight_bits(w: np.ndarray) -> np.ndarray:
    """Stored weights as the kernels that read them in place take them (HALF_BITS)."""
    return w.view(HALF_BITS.get(wtypes.of_array(w), w.dtype))


def _panel_scratch(wdt: str) -> int:
    """Bytes of gemmp's slab buffers (one a GEMM slot) for panels of weight type wdt."""
    return 0 if wdt == "f32" else up64(_nbytes((GEMM_SLOTS, GEMMP_SLAB_FLOATS)))


def _panel_operands(w: np.ndarray, scratch: np.ndarray, off: int) -> tuple:
    """(flat panels as gemmp reads them, its slab buffers, its workers): float32 panels
    need no buffer (one dummy row); other types are widened a slab at a time
    (kernels.panel_slab) into one buffer a worker, _panel_scratch's bytes at ``off`` in
    scratch, so the workers are at most GEMM_SLOTS."""
    wq = _readonly(_weight_bits(w).reshape(-1))
    workers = max(1, kernel_threads())
    if w.dtype == F32:
        return wq, _NOSLABS, workers
    slabs = _f32_slot(scratch, off, (GEMM_SLOTS, GEMMP_SLAB_FLOATS))[0]
    return wq, _readonly(slabs), min(workers, GEMM_SLOTS)


# --- conv (im2col + register-tiled GEMM) --------------------------------------------


def _is_pointwise(wshape: Sequence[int], attrs: dict) -> bool:
    return (
        tuple(wshape[2:]) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["pads"])
    )


# im2col runs in bands of output rows whose columns fit in L2, each band's GEMM reading
# them from cache: ResNet-18's 7x7 stem has 7.4 MB of columns, and its GEMM took 5.1 ms
# reading them from memory against 3.7 ms from cache. Bands stay wide enough for the
# GEMM to fill its column blocks.
BAND_BYTES = 512 * 1024
MIN_BAND_COLS = 512
# Workers of the GEMM (gemm_tiles.py): each packs its column blocks into its own slot.
GEMM_SLOTS = 4


def _band_rows(kk: int, oh: int, ow: int) -> int:
    rows = max(1, BAND_BYTES // (kk * ow * 4))
    return oh if rows >= oh or rows * ow < MIN_BAND_COLS else rows


def _gemm_xp_shape() -> tuple[int, int]:
    return GEMM_SLOTS, GEMM_XP_FLOATS


def _gemm_scratch_bytes() -> int:
    return up64(_nbytes(_gemm_xp_shape()))


def _gemm_slots(scratch: np.ndarray, off: int) -> tuple[np.ndarray, int]:
    """The GEMM's packing buffers at ``off`` in scratch (64-byte aligned)."""
    return _f32_slot(scratch, off, _gemm_xp_shape())[0], off + _gemm_scratch_bytes()


def _bound(kern, args: tuple) -> tuple:
    """(kern compiled for these arguments' types, the arguments): one kernel call of a
    step, made with the same arguments every run (native.resolved)."""
    return resolved(kern, args), args


def _widened(w: np.ndarray, scratch: np.ndarray):
    """(float32 weights, decode step or None, next scratch offset): int8/fp16 conv
    weights are widened into the front of scratch once per call, in their stored shape
    (the GEMM could read int8 directly, but widening each broadcast costs 3 instructions
    in its inner loop: ResNet-18 int8 took 103 ms that way against 71 for fp32)."""
    if w.dtype == F32:
        return w, None, 0
    wf, _ = _f32_slot(scratch, 0, w.shape)
    return wf, _decoder(w, wf), up64(_nbytes(w.shape))


def _gemm_operands(w2: np.ndarray, scratch: np.ndarray):
    """(float32 weights, decode step or None, GEMM slots, next scratch offset) of a
    channels-first conv (_widened, then the GEMM's packing slots)."""
    w2, decode, off = _widened(w2, scratch)
    xp, off = _gemm_slots(scratch, off)
    return w2, decode, xp[: max(1, min(GEMM_SLOTS, kernel_threads()))], off  # a slot a thread


def _conv_path(wshape: Sequence[int], x_shape: Sequence[int], out_shape, attrs: dict) -> str:
    """Which way a conv runs (the bundle records it; the bind takes it): channels-first
    ``pointwise`` (the input is the GEMM operand) or ``im2col`` (bands of columns);
    channels-last ``pointwise``, ``window`` (taps read in place), ``padded_window``
    (from a zero-padded copy) or ``im2row`` (a dilated width: taps copied into rows)."""
    if not layout.is_nhwc(attrs):
        return "pointwise" if _is_pointwise(wshape, attrs) else "im2col"
    _, kh, kw, cg, _ = wshape
    if _is_pointwise((0, cg, kh, kw), attrs):
        return "pointwise"
    if attrs["dilations"][1] != 1:
        return "im2row"
    padded = _padded_image(x_shape[1:], (kh, kw), out_shape[1:3], attrs)
    return "window" if padded is None else "padded_window"


def _conv_variant(ins, outs, attrs) -> str:
    io = _args("conv", ins)
    return _conv_path(io.w[0], io.x[0], outs[0], attrs)


def _conv_scratch(ins: Sequence[Spec | None], outs: Sequence[tuple[int, ...]], attrs: dict) -> int:
    """Decoded weights plus, channels-first, the GEMM's packing slots and one band of
    im2col columns; channels-last, the zero-padded image its taps are read from (none
    when the window never leaves the image), or with a dilated width a band of im2row
    rows."""
    (wshape, wdt) = _args("conv", ins).w
    if layout.is_nhwc(attrs):  # panels widened a slab at a time
        need = _panel_scratch(wdt)
        _, kh, kw, cg, _ = wshape
        oh, ow = outs[0][1], outs[0][2]
        if attrs["dilations"][1] == 1:
            padded = _padded_image(ins[0][0][1:], (kh, kw), (oh, ow), attrs)
            return need + (_nbytes(padded) if padded else 0)
    else:
        need = 0 if wdt == "f32" else up64(_nbytes(wshape))  # decoded weights, same shape
        _, cg, kh, kw = wshape
        oh, ow = outs[0][2], outs[0][3]
        need += _gemm_scratch_bytes()
    kk = cg * kh * kw
    if not _is_pointwise((1, cg, kh, kw), attrs):
        need += _nbytes((kk, _band_rows(kk, oh, ow) * ow))  # one band of columns / rows
    return need


def _bind_conv(ins, outs, scratch, attrs) -> Bound:
    if layout.is_nhwc(attrs):
        return _bind_conv_nhwc(ins, outs, scratch, attrs)
    io = _args("conv", ins)
    x, w, bias, scale, res = io.x, io.w, io.bias, io.scale, io.residual
    y = outs[0]
    n_, c_, h, wd = x.shape
    co, cg, kh, kw = w.shape
    g = attrs["group"]
    cog = co // g
    kk = cg * kh * kw
    oh, ow = y.shape[2], y.shape[3]
    p = oh * ow
    sh, sw = attrs["strides"]
    pt, pl, _, _ = attrs["pads"]
    dh, dw = attrs["dilations"]
    w2, decode, xp, off = _gemm_operands(w.reshape(co, kk), scratch)
    pointwise = _conv_path(w.shape, x.shape, y.shape, attrs) == "pointwise"
    band = _band_rows(kk, oh, ow)
    cols_flat = None if pointwise else _f32_slot(scratch, off, (kk * band * ow,))[0]
    bands = []  # (first output row, rows, contiguous columns buffer for them)
    for oy0 in range(0, oh, band):
        nb = min(band, oh - oy0)
        cols = None if pointwise else cols_flat[: kk * nb * ow].reshape(kk, nb * ow)
        bands.append((oy0, nb, cols))
    flags = _flags(bias, scale, res)
    act, a, b = _act(attrs)

    def per_group(vec: np.ndarray | None, gi: int) -> np.ndarray:
        return _DUMMY1 if vec is None else vec[gi * cog : (gi + 1) * cog]

    gemms = []  # (input, weights, output, bias, scale, residual, columns, im2col cut)
    for n in range(n_):
        for gi in range(g):
            xg = x[n, gi * cg : (gi + 1) * cg]
            yg = y[n, gi * cog : (gi + 1) * cog].reshape(cog, p)
            rg = None if res is None else res[n, gi * cog : (gi + 1) * cog].reshape(cog, p)
            wg = w2[gi * cog : (gi + 1) * cog]
            bg, sg = per_group(bias, gi), per_group(scale, gi)
            if pointwise:
                rr = _DUMMY2 if rg is None else rg
                gemms.append((xg.reshape(cg, h * wd), wg, yg, bg, sg, rr, None, None))
                continue
            for oy0, nb, cols in bands:  # a band is the image with its top rows cut off
                span = slice(oy0 * ow, (oy0 + nb) * ow)
                rr = _DUMMY2 if rg is None else rg[:, span]
                gemms.append((xg, wg, yg[:, span], bg, sg, rr, cols, (pt - oy0 * sh, nb)))
    gemm, im2col = K.gemm, K.im2col
    gemms = [
        (xg, _readonly(xg if cols is None else cols), wg, yg, bg, sg, rg, cols, cut)
        for xg, wg, yg, bg, sg, rg, cols, cut in gemms
    ]

    def step() -> None:
        if decode is not None:
            decode()
        for xg, rhs, wg, yg, bg, sg, rg, cols, cut in gemms:
            if cols is not None:
                im2col(xg, cols, kh, kw, sh, sw, cut[0], pl, dh, dw, cut[1], ow)
            gemm(wg, rhs, yg, bg, sg, rg, flags, act, a, b, xp)

    return step


# --- conv, channels-last (rows of pixels x output channels) ----------------------


def _padded_image(
    hwc: Sequence[int], k: Sequence[int], out_hw: Sequence[int], attrs: dict
) -> tuple[int, int, int] | None:
    """[Hp, Wp, C] of the zero-padded copy a channels-last conv reads its taps from:
    just the rows and columns its windows cover. None when they never leave the image
    (a 1x1 stride-2 conv): the taps are read in place."""
    h, wd, c = hwc
    (kh, kw), (oh, ow) = k, out_hw
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl, _, _ = attrs["pads"]
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    if pt == 0 and pl == 0 and hp <= h and wp <= wd:
        return None
    return (hp, wp, c)


def _bind_conv_nhwc(ins, outs, scratch, attrs) -> Bound:
    """y[P, Co] = rows[P, K] @ w[K, Co]: pixels are GEMM rows, output channels its
    vector columns, so a 7x7 image fills whole vectors; bias and scale per column.
    The weights come as panels (kernels/layout.py), read in place by gemmp. So are the
    taps: row p of the product is output pixel p's window, read from the image (zero
    padded into scratch when windows leave it) at offsets gemmp gets in a table, a
    kernel row of kw * C channels-contiguous taps at a time. Only a dilated width,
    whose taps are not contiguous, copies them into im2row rows first."""
    if attrs.get("group", 1) != 1 or attrs.get("panel") != PANEL:
        raise ValueError(
            f"a channels-last conv needs group 1 and weights in {PANEL}-wide panels "
            f"(packager/layout.py); got group {attrs.get('group', 1)}, "
            f"panel {attrs.get('panel')}"
        )
    io = _args("conv", ins)
    x, w, bias, scale, res = io.x, io.w, io.bias, io.scale, io.residual
    y = outs[0]
    n_, h, wd, c_ = x.shape
    _, kh, kw, cg, _ = w.shape
    oh, ow, co = y.shape[1], y.shape[2], y.shape[3]
    kk = kh * kw * cg
    sh, sw = attrs["strides"]
    pt, pl, _, _ = attrs["pads"]
    dh, dw = attrs["dilations"]
    wq, wbuf, workers = _panel_operands(w, scratch, 0)
    off = _panel_scratch(wtypes.of_array(w))
    flags = _flags(bias, scale, res) | PER_COL
    b_ = bias if bias is not None else _DUMMY1
    s_ = scale if scale is not None else _DUMMY1
    act, a, b = _act(attrs)
    calls = []  # (how to fill the rows operand first or None, gemmp's arguments)

    def product(fill, rows, rtab, run: int, nky: int, wrow: int, n: int, p0: int, np_: int):
        yb = y[n].reshape(oh * ow, co)[p0 : p0 + np_]
        rb = _DUMMY2 if res is None else res[n].reshape(oh * ow, co)[p0 : p0 + np_]
        epi = (b_, s_, rb, flags, act, a, b, workers)
        calls.append((fill, (_readonly(rows), rtab, run, nky, wrow, wq, yb, *epi, wbuf)))

    path = _conv_path(w.shape, x.shape, y.shape, attrs)
    if path == "pointwise":  # the image itself is the rows operand
        for n in range(n_):
            product(None, x[n].reshape(h * wd, c_), _NOROWS, kk, 1, 0, n, 0, oh * ow)
    elif path in ("window", "padded_window"):
        padded = _padded_image((h, wd, c_), (kh, kw), (oh, ow), attrs)
        pitch = wd if padded is None else padded[1]
        xp = None if padded is None else _f32_slot(scratch, off, padded)[0]
        oy, ox = np.divmod(np.arange(oh * ow, dtype=np.int64), ow)
        rtab = _readonly((oy * sh * pitch + ox * sw) * c_)  # each window's first tap
        for n in range(n_):
            fill = None if xp is None else (K.pad_nhwc, (x[n], xp, pt, pl))
            src = x[n] if xp is None else xp
            product(fill, src.reshape(-1, c_), rtab, kw * c_, kh, dh * pitch * c_, n, 0, oh * ow)
    else:  # taps not contiguous: copied into im2row rows, a band of output rows at a time
        band = _band_rows(kk, oh, ow)
        rows_flat = _f32_slot(scratch, off, (band * ow * kk,))[0]
        for n in range(n_):
            for oy0 in range(0, oh, band):
                nb = min(band, oh - oy0)
                rows = rows_flat[: nb * ow * kk].reshape(-1, kk)
                fill = (K.im2row, (x[n], rows, kh, kw, sh, sw, pt, pl, dh, dw, oy0, ow))
                product(fill, rows, _NOROWS, kk, 1, 0, n, oy0 * ow, nb * ow)
    calls = [(fill and _bound(*fill), _bound(K.gemmp, args)) for fill, args in calls]

    def step() -> None:
        for fill, (gemmp, args) in calls:
            if fill is not None:
                fill[0](*fill[1])
            gemmp(*args)

    return step


# --- conv on int8 activations (kernels/cpu/qgemm.py) -------------------------------


def _qconv_image(x_shape: Sequence[int], out_shape: Sequence[int], attrs: dict):
    """(rows, columns, x's row and column offset, row and column step) of the u8 image
    a qconv's windows read (qgemm.quantize_pad_nhwc): for a 1x1 conv just its pixels
    (a strided one then runs at stride 1 on them), else the zero-point-padded span its
    windows cover, or x itself when they never leave it."""
    (sh, sw), (pt, pl) = attrs["strides"], attrs["pads"][:2]
    if tuple(attrs["kernel"]) == (1, 1):
        return out_shape[1], out_shape[2], pt, pl, sh, sw
    padded = _padded_image(x_shape[1:], attrs["kernel"], out_shape[1:3], attrs)
    if padded is None:
        return x_shape[1], x_shape[2], 0, 0, 1, 1
    return padded[0], padded[1], pt, pl, 1, 1


def _qgemm_scratch_shape() -> tuple[int, int]:
    return GEMM_SLOTS, qgemm_scratch_int64s()


def _qconv_scratch(ins, outs, attrs) -> int:
    hp, wp = _qconv_image(ins[0][0], outs[0], attrs)[:2]
    image = up64(hp * wp * int(attrs["in_channels"]) + QGEMM_SLACK)
    return image + _nbytes(_qgemm_scratch_shape(), 8)


def _bind_qconv(ins, outs, scratch, attrs) -> Bound:
    """y[P, Co] from the u8 image: quantize (and pad) x into scratch, then gemm_u8s8
    reads each output pixel's window in place (qgemm.py), a kernel row of kw * C taps
    at a time, the epilogue fused."""
    io = _args("qconv", ins)
    x, w, bias, scale, res, zw = io.x, io.w, io.bias, io.scale, io.residual, io.zw
    y = outs[0]
    n_, _, _, c_ = x.shape
    kh, _ = attrs["kernel"]
    oh, ow, co = y.shape[1], y.shape[2], y.shape[3]
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    if dw != 1:
        raise ValueError(f"qconv needs contiguous taps along the width; dilation {dw}")
    hp, wp, pt, pl, step_h, step_w = _qconv_image(x.shape, y.shape, attrs)
    if step_h > 1 or step_w > 1:  # the gathered pixels of a strided 1x1 conv
        sh = sw = 1
    image = up64(hp * wp * c_ + QGEMM_SLACK)
    xq = scratch[: hp * wp * c_ + QGEMM_SLACK]
    # u8 codes from an int8 op that are already the image (a 1x1 stride-1 conv whose
    # runs of C taps read no byte past a pixel) are read where they are
    in_place = (x.dtype == np.uint8 and (hp, wp, step_h, step_w) == (x.shape[1], x.shape[2], 1, 1)
                and (pt, pl) == (0, 0) and c_ % 4 == 0)  # fmt: skip
    nslot = max(1, min(GEMM_SLOTS, kernel_threads()))  # a row of gemm scratch a thread
    qs = scratch[image : image + _nbytes(_qgemm_scratch_shape(), 8)]
    qs = qs.view(np.int64).reshape(_qgemm_scratch_shape())[:nslot]
    oy, ox = np.divmod(np.arange(oh * ow, dtype=np.int64), ow)
    rtab = _readonly((oy * sh * wp + ox * sw) * c_)  # each window's first byte
    flags = _flags(bias, None, res)
    act, a, b = _act(attrs)
    s, z = np.float32(attrs["x_scale"]), int(attrs["x_zero"])
    yinv, yz = _y_codes(attrs, y)
    b_ = bias if bias is not None else _DUMMY1
    wq = _readonly(w.reshape(-1))
    calls = []
    for n in range(n_):
        yn = y[n].reshape(oh * ow, co)
        rn = _DUMMY2 if res is None else res[n].reshape(oh * ow, co)
        fill = None if in_place else _bound(
            K.quantize_pad_nhwc, (x[n], xq, hp, wp, pt, pl, step_h, step_w, s, z))
        xr = _readonly(x[n].reshape(-1) if in_place else xq)
        gemm = (K.gemm_u8s8, (xr, rtab, int(attrs["run4"]), kh, dh * wp * c_, wq, zw, yn, b_,
                              scale, rn, flags, act, a, b, yinv, yz, qs))  # fmt: skip
        calls.append((fill, _bound(*gemm)))

    def step() -> None:
        for fill, (gf, ga) in calls:
            if fill is not None:
                fill[0](*fill[1])
            gf(*ga)

    return step


def _y_codes(attrs: dict, y: np.ndarray) -> tuple[np.float32, np.float32]:
    """(1 / scale, zero point) of an int8 op's u8 output (kernels/ref requantize_u8),
    checked against the output's dtype; (1, 0) for a float32 output, unused."""
    codes = "y_scale" in attrs
    if codes != (y.dtype == np.uint8):
        raise ValueError(f"output dtype {y.dtype} with y_scale {attrs.get('y_scale')}")
    if not codes:
        return np.float32(1), np.float32(0)
    return np.float32(1) / np.float32(attrs["y_scale"]), np.float32(attrs["y_zero"])


def _bind_qdwconv(ins, outs, scratch, attrs) -> Bound:
    """3x3 depthwise conv into u8 codes, one image at a time (qdw.qdwconv3)."""
    io = _args("qdwconv", ins)
    x, w, bias, scale, y = io.x, io.w, io.bias, io.scale, outs[0]
    if tuple(w.shape[:2]) != (3, 3):
        raise ValueError(f"qdwconv takes 3x3 weights, not {w.shape}")
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl = attrs["pads"][:2]
    act, a, b = _act(attrs)
    if act not in (0, 1, 3):
        raise ValueError(f"qdwconv clamps (relu, clip) only, not {attrs.get('act')}")
    yinv, yz = _y_codes(attrs, y)
    if x.dtype != np.float32:
        raise ValueError(f"qdwconv takes float32 input, not {x.dtype}")
    b_ = bias if bias is not None else _DUMMY1
    flags = _flags(bias, None, None)
    calls = [_bound(K.qdwconv3, (x[n], w, b_, scale, y[n], sh, sw, pt, pl, dh, dw, flags, act,
                                 a, b, yinv, yz))
             for n in range(x.shape[0])]  # fmt: skip

    def step() -> None:
        for f, a_ in calls:
            f(*a_)

    return step


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: the GEMM's operands are typed read-only (weights are mapped
    read-only), so activations and scratch pass as read-only views of themselves."""
    v = a.view()
    v.flags.writeable = False
    return v


# --- 3x3 conv, Winograd (weights transformed by the packager) ----------------------

# Per-slot working tiles of the transforms (gemm_tiles.wino_conv_*): tiles
# are dealt to slots statically, which caps the threads the transforms use (edge CPUs
# have 4-8 cores) and fixes the scratch size at plan time whatever the device's thread
# count. Each slot holds a*a vectors of at most WINO_LANES floats.
WINO_SLOTS = 8
# The widest vector of any target (AVX-512); 8 and 4 divide it. Channels-last working
# planes also round their channel count up to it, so no transform takes a partial vector.
WINO_LANES = 16


def _wino_dims(ushape: Sequence[int], out_shape: Sequence[int], attrs: dict) -> tuple:
    m = int(attrs["tile"])
    a2, ci, co = ushape
    th, tw = winograd.tiles(out_shape[1:3] if layout.is_nhwc(attrs) else out_shape[2:], m)
    return m, a2, co, ci, th, tw


# Tile rows per block: a block's V and M stay in L2 while each U[e] is reused across
# the blocks, when U is small enough to stay there too (64-channel layers: ResNet-18's
# stage 1 moved 11 MB through memory per conv unblocked). Wider layers take all tiles
# in one block: their U would be streamed once per block.
WINO_BLOCK_BYTES = 512 * 1024
WINO_U_L2_BYTES = 640 * 1024


def _wino_layout(ushape, out_shape, attrs) -> tuple[list[tuple[str, tuple[int, ...]]], dict]:
    """The scratch buffers of one Winograd conv, in order: (name, float32 shape)."""
    m, a2, co, ci, th, tw = _wino_dims(ushape, out_shape, attrs)
    a = m + 2
    cip = -(-ci // WINO_LANES) * WINO_LANES
    cop = -(-co // WINO_LANES) * WINO_LANES
    per_row = tw * a2 * (cip + cop) * 4  # V and M of one row of tiles
    rows = th
    if th * per_row > WINO_BLOCK_BYTES and a2 * ci * co * 4 <= WINO_U_L2_BYTES:
        rows = max(1, min(th, WINO_BLOCK_BYTES // per_row))
    tb = rows * tw
    bufs = [
        ("xt", ((th - 1) * m + a, (tw - 1) * m + a, cip)),  # channels-last input planes
        ("yt", (rows * m, tw * m, cop)),  # channels-last output rows of one block
        ("vb", (a2, tb, cip)),  # V of one block of tiles
        ("mb", (a2, tb, cop)),  # M of one block
        ("tmp", (WINO_SLOTS, a2 * WINO_LANES)),
        ("xp", _gemm_xp_shape()),
    ]
    return bufs, {"m": m, "tw": tw}


def _wino_scratch(ins, outs, attrs) -> int:
    bufs, _ = _wino_layout(_args("conv_wino", ins).w[0], outs[0], attrs)
    return sum(up64(_nbytes(shape)) for _, shape in bufs)


def _bind_conv_wino(ins, outs, scratch, attrs) -> Bound:
    io = _args("conv_wino", ins)
    x, u, bias, scale, res = io.x, _weight_bits(io.w), io.bias, io.scale, io.residual
    y = outs[0]
    bufs, dims = _wino_layout(u.shape, y.shape, attrs)
    views, off = {}, 0
    for name, shape in bufs:
        views[name] = _f32_slot(scratch, off, shape)[0]
        off += up64(_nbytes(shape))
    xt, yt, vb, mb, tmp = (views[k] for k in ("xt", "yt", "vb", "mb", "tmp"))
    xp = views["xp"][: max(1, min(GEMM_SLOTS, kernel_threads()))]  # one slot per thread
    m, tw = dims["m"], dims["tw"]
    pt, pl, _, _ = attrs["pads"]
    flags = _flags(bias, scale, res)
    b_ = bias if bias is not None else _DUMMY1
    s_ = scale if scale is not None else _DUMMY1
    act, a, b = _act(attrs)
    items = [(x[n], y[n], res[n] if res is not None else _DUMMY3) for n in range(x.shape[0])]
    tail = (flags, act, a, b, int(layout.is_nhwc(attrs)))
    calls = []
    for xn, yn, rn in items:
        args = (xn, xt, u, vb, mb, yt, tmp, xp, yn, m, pt, pl, tw, b_, s_, rn, *tail)
        calls.append(_bound(K.wino_conv, args))

    def step() -> None:
        for conv, args in calls:
            conv(*args)

    return step


# --- depthwise conv (direct) ------------------------------------------------------


# 3x3 depthwise special cases. Stride 1 on small images takes the flat-plane kernel
# (dwconv3_flat): 2x faster than the row-wise one at 7x7..28x28, even at 56x56, slower
# at 112x112. Stride 2 splits rows into even/odd columns once (dwconv3_s2).
FLAT_DW_MAX_SIDE = 28
DW_SLOTS = 8  # channels dealt to per-slot planes, as in the Winograd transforms


def _dw_planes(wshape, out_shape, attrs) -> tuple[str, tuple[int, ...]] | None:
    """(kernel, shape of its per-slot planes) for the 3x3 special cases, else None (the
    row-wise ``dwconv`` runs): stride 1 on small images, stride 2 at any size."""
    if (
        tuple(wshape[2:]) != (3, 3)
        or list(attrs["dilations"]) != [1, 1]
        or list(attrs["pads"]) != [1, 1, 1, 1]
    ):
        return None
    oh, ow = out_shape[2], out_shape[3]
    if list(attrs["strides"]) == [1, 1] and max(oh, ow) <= FLAT_DW_MAX_SIDE:
        return "dwconv3_flat", (DW_SLOTS, 2, (oh + 2) * (ow + 2) + 2)  # +2: taps overrun
    if list(attrs["strides"]) == [2, 2]:
        return "dwconv3_s2", (DW_SLOTS, 2, (2 * oh + 1) * (ow + 1))  # even / odd columns
    return None


def _dw_path(wshape: Sequence[int], out_shape, attrs: dict) -> str:
    """Which depthwise kernel runs (the bundle records it; the bind takes it): planar
    ``dwconv3_flat`` / ``dwconv3_s2`` (the 3x3 special cases) or ``rows``; channels-last
    ``dw3`` (3x3 in vectors) or ``rows_nhwc``."""
    if layout.is_nhwc(attrs):
        return "dw3" if tuple(wshape[:2]) == (3, 3) else "rows_nhwc"
    special = _dw_planes(wshape, out_shape, attrs)
    return special[0] if special else "rows"


def _dw_kernel(path: str):
    """The kernel of a ``_dw_path`` that is not a planar 3x3 special case; all take the
    same arguments (dw3: 3x3 windows in explicit vectors, weights in registers)."""
    return {"dw3": K.dw3, "rows_nhwc": K.dwconv_nhwc, "rows": K.dwconv}[path]


def _dw_variant(ins, outs, attrs) -> str:
    return _dw_path(_args("dwconv", ins).w[0], outs[0], attrs)


def _dw_scratch(ins, outs, attrs) -> int:
    wshape, wdt = _args("dwconv", ins).w
    need = 0 if wdt in _READ_IN_PLACE else _nbytes(wshape)
    if layout.is_nhwc(attrs):  # channels-last: vectors along channels, no planes
        return need
    special = _dw_planes(wshape, outs[0], attrs)
    return need + (_nbytes(special[1]) if special else 0)


def _bind_dwconv(ins, outs, scratch, attrs) -> Bound:
    io = _args("dwconv", ins)
    x, w, bias, scale, res = io.x, io.w, io.bias, io.scale, io.residual
    y = outs[0]
    decode, off = None, 0
    if wtypes.of_array(w) not in _READ_IN_PLACE:  # e.g. fp16: numba has no CPU float16
        wf, off = _f32_slot(scratch, 0, w.shape)
        decode = _decoder(w, wf)
        w = wf
    path = _dw_path(w.shape, y.shape, attrs)
    special = _dw_planes(w.shape, y.shape, attrs) if path.startswith("dwconv3") else None
    sh, sw = attrs["strides"]
    pt, pl, _, _ = attrs["pads"]
    dh, dw = attrs["dilations"]
    flags = _flags(bias, scale, res)
    b_ = bias if bias is not None else _DUMMY1
    s_ = scale if scale is not None else _DUMMY1
    act, a, b = _act(attrs)
    items = [(x[n], y[n], res[n] if res is not None else _DUMMY3) for n in range(x.shape[0])]
    if special is not None:
        planes = _f32_slot(scratch, off, special[1])[0]
        flat = getattr(K, special[0])

        def step_flat() -> None:
            if decode is not None:
                decode()
            for xn, yn, rn in items:
                flat(xn, w, b_, s_, rn, yn, planes, flags, act, a, b)

        return step_flat
    kern = _dw_kernel(path)
    calls = []
    for xn, yn, rn in items:
        args = (xn, w, b_, s_, rn, yn, sh, sw, pt, pl, dh, dw, flags, act, a, b)
        calls.append(_bound(kern, args))

    def step() -> None:
        if decode is not None:
            decode()
        for kern, args in calls:
            kern(*args)

    return step


# --- linear -----------------------------------------------------------------------


_BLAS_MATMUL = lend_cores(np.matmul)  # every BLAS call of this backend (pool.lend_cores)

# Rows of x up to which fp16/bf16 linears run the GEMV (weights widened in registers,
# kernels/cpu/gemv.py); above, they are widened once a run into scratch for BLAS, whose
# GEMM outruns a GEMV per row.
HALF_GEMV_MAX_ROWS = 8
# int8 does the same up to this many weights (4 MB of float32 scratch): an encoder's
# 128 rows through the GEMV took MiniLM int8 to 2.3x its fp32 time. Larger int8 weights
# (an LLM's prompt chunks) keep the GEMV, whose scratch would be the widened matrix.
I8_DECODE_MAX_WEIGHTS = 1 << 20


def _linear_path(wdt: str, rows: int, weights: int = 0, panel: bool = False) -> str:
    """``gemmp`` (weights the packager stored as panels: small linears; float32 read in
    place, other types widened a slab at a time), ``gemv_<wdt>``
    (weights read in place, kernels/cpu/gemv.py), ``blas`` (float32) or ``decode_blas``
    (fp16/bf16, and int8 of at most I8_DECODE_MAX_WEIGHTS, at more than
    HALF_GEMV_MAX_ROWS rows: widened into scratch first, the int8 scale in the
    epilogue)."""
    if panel:
        return "gemmp"
    if wdt == "f32":
        return "blas"
    if rows <= HALF_GEMV_MAX_ROWS or (wdt == "i8" and weights > I8_DECODE_MAX_WEIGHTS):
        return f"gemv_{wdt}"
    return "decode_blas"


def _linear_variant(ins, outs, attrs) -> str:
    x, w = _args("linear", ins).x, _args("linear", ins).w
    rows = int(np.prod(x[0][:-1], dtype=np.int64))
    return _linear_path(w[1], rows, int(np.prod(w[0])), attrs.get("panel") == PANEL)


def _linear_scratch(ins, outs, attrs) -> int:
    wshape, wdt = _args("linear", ins).w
    path = _linear_variant(ins, outs, attrs)
    if path == "gemmp":
        return _panel_scratch(wdt)
    return _nbytes(wshape) if path.startswith("decode") else 0


def _bind_linear(ins, outs, scratch, attrs) -> Bound:
    io = _args("linear", ins)
    x, w, bias, scale = io.x, io.w, io.bias, io.scale
    y = outs[0]
    kdim = x.shape[-1]
    x2 = x.reshape(-1, kdim)
    y2 = y.reshape(-1, y.shape[-1])
    flags = _flags(bias, scale, None)
    b_ = bias if bias is not None else _DUMMY1
    s_ = scale if scale is not None else _DUMMY1
    act, a, b = _act(attrs)
    wdt = wtypes.of_array(w)
    path = _linear_path(wdt, x2.shape[0], w.size, attrs.get("panel") == PANEL)
    if path == "gemmp":  # x is the rows operand, as for a pointwise conv
        wq, wbuf, workers = _panel_operands(w, scratch, 0)
        epi = (b_, s_, _DUMMY2, flags | PER_COL, act, a, b, workers, wbuf)
        kern, args = _bound(K.gemmp, (_readonly(x2), _NOROWS, kdim, 1, 0, wq, y2, *epi))
        return lambda: kern(*args)
    if path.startswith("gemv"):
        wv = _weight_bits(w)
        kern, args = _bound(K.gemv, (_readonly(x2), wv, b_, s_, y2, flags, act, a, b))
        return lambda: kern(*args)
    decode = None
    if path == "decode_blas":
        wf = _f32_slot(scratch, 0, w.shape)[0]
        decode = _decoder(w, wf)
        w = wf
    wt = w.T  # a transposed view: BLAS reads it with the transpose flag, no copy
    matmul, epilogue = _BLAS_MATMUL, K.epilogue_cols
    needs_epilogue = flags != 0 or act != 0

    def step() -> None:
        if decode is not None:
            decode()
        matmul(x2, wt, out=y2)
        if needs_epilogue:
            epilogue(y2, b_, s_, flags, act, a, b)

    return step


# --- elementwise, pooling, data movement -------------------------------------------


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _with_act(y: np.ndarray, attrs: dict):
    act, a, b = _act(attrs)
    if act == 0:
        return None
    yf = _flat(y)
    return lambda: K.act_into(yf, yf, act, a, b)


def _bind_matmul(ins, outs, scratch, attrs) -> Bound:
    a_, b_, y = ins[0], ins[1], outs[0]
    post = _with_act(y, attrs)
    matmul = _BLAS_MATMUL

    def step() -> None:
        matmul(a_, b_, out=y)
        if post is not None:
            post()

    return step


_UFUNC = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum, "pow": np.power}  # fmt: skip
_KIND = {k: i for i, k in enumerate(BINARY_KINDS)}


def _rows_form(a_: np.ndarray, b_: np.ndarray, y: np.ndarray):
    """(x [R, C], z [R or 1, C or 1], rev) when one operand has y's shape and the other
    varies along a leading or a trailing run of y's axes only (a channel vector in either
    layout, a row, a scalar): binary_rows' form. None otherwise."""
    for full, small, rev in ((a_, b_, 0), (b_, a_, 1)):
        if (
            full.shape != y.shape
            or small.ndim > y.ndim
            or not (full.flags.c_contiguous and small.flags.c_contiguous)
        ):
            continue
        s = (1,) * (y.ndim - small.ndim) + small.shape
        if any(d not in (1, n) for d, n in zip(s, y.shape)):
            continue
        axes = [i for i, n in enumerate(y.shape) if n != 1]  # size-1 axes go either way
        varies = [s[i] != 1 for i in axes]
        lead = next((j for j, v in enumerate(varies) if not v), len(varies))
        if not any(varies[lead:]):  # varies on leading axes only: a value a row
            p = axes[lead] if lead < len(axes) else y.ndim
            z_rows = True
        else:
            lead = varies.index(True)
            if not all(varies[lead:]):
                continue
            p, z_rows = axes[lead], False
        rows, cols = int(np.prod(y.shape[:p])), int(np.prod(y.shape[p:]))
        z2 = small.reshape((rows, 1) if z_rows else (1, cols))
        return _readonly(full.reshape(rows, cols)), _readonly(z2), rev
    return None


def _bind_binary(ins, outs, scratch, attrs) -> Bound:
    a_, b_, y = ins[0], ins[1], outs[0]
    if y.dtype != np.float32:  # integer tensors (ops.out_dtype allowed the kind)
        return G.int_binary_step(np, a_, b_, y, attrs["kind"])
    kind = _KIND[attrs["kind"]]
    act, a, b = _act(attrs)
    if all(t.shape == y.shape for t in (a_, b_)):
        pass  # same shapes: the ufunc below, in place or not, allocates nothing
    elif (rows := _rows_form(a_, b_, y)) is not None:
        x2, z2, rev = rows
        kern, args = _bound(K.binary_rows, (x2, z2, y.reshape(x2.shape), kind, rev, act, a, b))
        return lambda: kern(*args)
    elif y.ndim <= 4:
        # Other broadcasts: a numba loop over 4-D broadcast views; NumPy's ufuncs
        # allocate a 32 KB buffer a call to broadcast a small operand, in place or not.
        shape4 = (1,) * (4 - y.ndim) + y.shape
        x4 = np.broadcast_to(a_.reshape((1,) * (4 - a_.ndim) + a_.shape), shape4)
        z4 = np.broadcast_to(b_.reshape((1,) * (4 - b_.ndim) + b_.shape), shape4)
        y4 = y.reshape(shape4)
        kern = K.binary4
        return lambda: kern(x4, z4, y4, kind, act, a, b)
    uf = _UFUNC[attrs["kind"]]
    post = _with_act(y, attrs)
    quiet = attrs["kind"] in ("div", "pow")  # x / 0, 0 ** -1: IEEE results, no warnings

    def step() -> None:
        if quiet:
            with np.errstate(all="ignore"):
                uf(a_, b_, out=y)
        else:
            uf(a_, b_, out=y)
        if post is not None:
            post()

    return step


def _bind_unary(ins, outs, scratch, attrs) -> Bound:
    xf, yf = _flat(ins[0]), _flat(outs[0])
    act, a, b = _act(attrs)
    kern = K.act_into
    return lambda: kern(xf, yf, act, a, b)


def _math_args(attrs) -> tuple[int, float, float]:
    a, b = attrs.get("args", (0.0, 0.0))
    return math_code(attrs["fn"]), float(a), float(b)


def _bind_math(ins, outs, scratch, attrs) -> Bound:
    xf, yf = _flat(ins[0]), _flat(outs[0])
    kern, args = _bound(K.math_into, (xf, yf, *_math_args(attrs)))
    return lambda: kern(*args)


def _bind_softmax(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    ax = attrs["axis"] % x.ndim
    outer = int(np.prod(x.shape[:ax]))
    inner = int(np.prod(x.shape[ax + 1 :]))
    shape3 = (outer, x.shape[ax], inner)
    x3, y3 = x.reshape(shape3), y.reshape(shape3)
    kern, log = K.softmax3, bool(attrs.get("log"))
    return lambda: kern(x3, y3, log)


def _as4(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _sdpa_scratch(ins, outs, attrs) -> int:
    """One row of scores for each (batch, head) pair (sdpa4 runs the pairs in parallel)."""
    q, v = ins[0][0], ins[2][0]
    return 4 * int(np.prod(q[:-2])) * v[-2]


def _bind_sdpa(ins, outs, scratch, attrs) -> Bound:
    q, k, v, mask = (list(ins) + [None] * 4)[:4]
    q4, k4, v4, y4 = (_as4(a) for a in (q, k, v, outs[0]))
    nb, nh, sq, _ = q4.shape
    sk = v4.shape[2]
    m = _as4(mask if mask is not None else _DUMMY1)
    m4 = np.broadcast_to(m, (nb, nh, sq, sk) if mask is not None else m.shape)  # zero strides
    s = scratch.view(np.float32)[: nb * nh * sk].reshape(nb * nh, sk)
    args = (*(_readonly(a) for a in (q4, k4, v4)), m4, y4, s, np.float32(attrs["scale"]),
            bool(attrs.get("k_t")), mask is not None, bool(attrs.get("nan_zero")))  # fmt: skip
    kern, args = _bound(K.sdpa4, args)
    return lambda: kern(*args)


def _bind_pool(kind: str):
    def bind(ins, outs, scratch, attrs) -> Bound:
        x, y = ins[0], outs[0]
        kh, kw = attrs["kernel"]
        sh, sw = attrs["strides"]
        pt, pl, pb, pr = attrs["pads"]
        items = [(x[n], y[n]) for n in range(x.shape[0])]
        if kind == "max":
            dh, dw = attrs.get("dilations", (1, 1))
            kern = K.maxpool_nhwc if layout.is_nhwc(attrs) else K.maxpool  # same arguments

            def step() -> None:
                for xn, yn in items:
                    kern(xn, yn, kh, kw, sh, sw, pt, pl, dh, dw)

            return step
        inc = 1 if attrs.get("count_include_pad", 0) else 0
        kern = K.avgpool

        def step_avg() -> None:
            for xn, yn in items:
                kern(xn, yn, kh, kw, sh, sw, pt, pl, pb, pr, inc)

        return step_avg

    return bind


def _bind_global_avgpool(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    if layout.is_nhwc(attrs):  # x[N, H, W, C] -> y[N, C, 1, 1]
        n_, c_ = x.shape[0], x.shape[-1]
        items = [(x[n].reshape(-1, c_), y[n].reshape(c_)) for n in range(n_)]
        kern_last = K.global_avgpool_nhwc

        def step_last() -> None:
            for xn, yn in items:
                kern_last(xn, yn)

        return step_last
    rows = x.shape[0] * x.shape[1]
    x2, y1 = x.reshape(rows, -1), y.reshape(rows)
    kern = K.global_avgpool
    return lambda: kern(x2, y1)


def _bind_channel_affine(ins, outs, scratch, attrs) -> Bound:
    io = _args("channel_affine", ins)
    x, scale, shift, y = io.x, io.scale, io.shift, outs[0]
    n_, c_ = x.shape[0], x.shape[1]
    x3, y3 = x.reshape(n_, c_, -1), y.reshape(n_, c_, -1)
    act, a, b = _act(attrs)
    kern = K.channel_affine
    return lambda: kern(x3, scale, shift, y3, act, a, b)


def _bind_reshape(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    if np.shares_memory(x, y):  # the memory plan aliased them: nothing to do
        return None
    src = x.reshape(y.shape)
    return lambda: np.copyto(y, src)


def _bind_transpose(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    perm = tuple(attrs["perm"])
    if perm in (layout.TO_NHWC, layout.TO_NCHW):  # the layout pass's conversions
        kern = K.to_channels_last if perm == layout.TO_NHWC else K.to_channels_first
        items = [(x[n], y[n]) for n in range(x.shape[0])]

        def step_layout() -> None:
            for xn, yn in items:
                kern(xn, yn)

        return step_layout
    form = swap_form(x.shape, perm) if x.dtype == F32 else None
    if form is not None:
        a, b, c, d = form
        kern, args = _bound(K.swap_axes, (_readonly(x.reshape(a, b, c, d)), y.reshape(a, c, b, d)))
        return lambda: kern(*args)
    src = x.transpose(perm)
    return lambda: np.copyto(y, src)


def swap_form(shape: Sequence[int], perm: Sequence[int]) -> tuple[int, int, int, int] | None:
    """(A, B, C, D) when transposing ``shape`` by ``perm`` is swap_axes' [A, B, C, D] ->
    [A, C, B, D] once size-1 axes are dropped and axes that stay neighbours merged;
    None for other permutations (and for no movement at all)."""
    groups: list[list[int]] = []  # runs of input axes, in output order
    for ax in (a for a in perm if shape[a] != 1):
        if groups and groups[-1][-1] + 1 == ax:
            groups[-1].append(ax)
        else:
            groups.append([ax])
    firsts = sorted(g[0] for g in groups)
    p = tuple(firsts.index(g[0]) for g in groups)  # output group i is input group p[i]
    size = [0] * len(groups)  # in input order
    for g, i in zip(groups, p):
        size[i] = int(np.prod([shape[a] for a in g]))
    forms = {(1, 0): (1, *size, 1), (0, 2, 1): (*size, 1), (1, 0, 2): (1, *size),
             (0, 2, 1, 3): tuple(size)}  # fmt: skip
    return forms.get(p)


def _bind_rows(ins, outs, scratch, attrs) -> Bound:
    start, y = int(attrs["start"]), outs[0]
    src = ins[0][start : start + y.shape[0]]
    return lambda: np.copyto(y, src)


def _as3(a: np.ndarray, ax: int) -> np.ndarray:
    return a.reshape(int(np.prod(a.shape[:ax])), a.shape[ax], int(np.prod(a.shape[ax + 1 :])))


def _deconv_as_gemm(x_shape, w_shape, y_shape, attrs) -> bool:
    """A ConvTranspose whose kernel equals its stride (no overlap, no pads, no output
    padding, group 1): one GEMM and a pixel shuffle. PP-OCRv4's detector upsamples with
    two: the gather loop took 173 and 30 ms of its 371 at 1 thread."""
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    return (
        int(attrs["group"]) == 1 and (dh, dw) == (1, 1) and not any(attrs["pads"])
        and tuple(w_shape[2:]) == (sh, sw)
        and tuple(y_shape[2:]) == (x_shape[2] * sh, x_shape[3] * sw)
    )  # fmt: skip


def _conv_transpose_scratch(ins, outs, attrs) -> int:
    x, w = ins[0][0], ins[1][0]
    if not _deconv_as_gemm(x, w, outs[0], attrs):
        return 0
    return 4 * int(np.prod(outs[0][1:]))  # one image's [Co*kh*kw, H*W]


def _bind_deconv_gemm(x, w, bias, y, scratch, attrs) -> Bound:
    n, ci, h, wd = x.shape
    co, (sh, sw) = w.shape[1], attrs["strides"]
    wt = w.reshape(ci, co * sh * sw).T  # [Co*kh*kw, Ci], a view the BLAS call transposes
    tmp = scratch.view(np.float32)[: co * sh * sw * h * wd].reshape(co * sh * sw, h * wd)
    rows = tmp.reshape(co, sh * sw * h * wd)
    b2 = _readonly(bias.reshape(co, 1)) if bias is not None else None
    add = (
        resolved(K.binary_rows, (_readonly(rows), b2, rows, 0, 0, 0, 0.0, 0.0))
        if b2 is not None
        else None
    )
    items = []
    for i in range(n):
        # y[co, i*sh + a, j*sw + b] = tmp[co, a, b, i, j]
        shuffled = y[i].reshape(co, h, sh, wd, sw).transpose(0, 2, 4, 1, 3)
        items.append((x[i].reshape(ci, h * wd), shuffled))
    src = tmp.reshape(co, sh, sw, h, wd)
    ro_rows = _readonly(rows)

    def step() -> None:
        for x2, dst in items:
            _BLAS_MATMUL(wt, x2, out=tmp)
            if add is not None:
                add(ro_rows, b2, rows, 0, 0, 0, 0.0, 0.0)
            np.copyto(dst, src)

    return step


def _bind_conv_transpose(ins, outs, scratch, attrs) -> Bound:
    io = _args("conv_transpose", ins)
    if _deconv_as_gemm(io.x.shape, io.w.shape, outs[0].shape, attrs):
        return _bind_deconv_gemm(io.x, io.w, io.bias, outs[0], scratch, attrs)
    bias = io.bias if io.bias is not None else _DUMMY1
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl = int(attrs["pads"][0]), int(attrs["pads"][1])
    call = (io.x, io.w, bias, outs[0], int(sh), int(sw), pt, pl, int(dh), int(dw),
            int(attrs["group"]), io.bias is not None)  # fmt: skip
    kern, args = _bound(K.conv_transpose, call)
    return lambda: kern(*args)


def _bind_resample(ins, outs, scratch, attrs) -> Bound:
    io, ax = _args("resample", ins), int(attrs["axis"])
    if io.w.shape[1] == 1 and np.all(io.w == 1.0):
        # one tap of weight 1 (nearest, and Gather at constant indices): a take along
        # the axis, mode "clip" so NumPy writes straight into the output (its "raise"
        # buffers); PP-OCRv4's detector's x2..x8 nearest upsamplings took 56 ms of its
        # 173 in the tap loop
        idx = np.ascontiguousarray(io.idx[:, 0], dtype=np.intp)
        x, y = io.x, outs[0]
        return lambda: np.take(x, idx, axis=ax, out=y, mode="clip")
    call = (_as3(io.x, ax), io.idx, io.w, _as3(outs[0], ax))
    kern, args = _bound(K.resample3, call)
    return lambda: kern(*args)


def _reduce_scratch(ins, outs, attrs) -> int:
    x, y = int(np.prod(ins[0][0])), int(np.prod(outs[0]))
    return 4 * G.reduce_scratch_floats(attrs["kind"], x, y)


def _bind_reduce(ins, outs, scratch, attrs) -> Bound:
    return G.reduce_step(np, ins[0], outs[0], scratch.view(np.float32), attrs)


# The rnn kernel makes the input gates itself (rank-1 updates over W^T, kernels.py
# rnn_recur) while W fits in L2 as float32; past that a GEMM by NumPy reads it once.
_RNN_IN_LOOP_FLOATS = 16384


def _rnn_variant(ins, outs, attrs) -> str:
    (g, i), _ = ins[1]
    return "in_loop" if g * i <= _RNN_IN_LOOP_FLOATS else "gemm"


def _rnn_scratch(ins, outs, attrs) -> int:
    """The shared plan's scratch (kernels/recurrent.py), then R^T [H, G*H] for the
    recurrence, then W^T [I, G*H] for the in_loop variant (kernels.rnn_recur)."""
    (steps, batch, _), _ = ins[0]
    hid = outs[0][2]
    (g, i), _ = ins[1]
    wt = g * i if _rnn_variant(ins, outs, attrs) == "in_loop" else 0
    return 4 * (rnn_scratch_floats(attrs["cell"], steps, batch, hid) + hid * g + wt)


def _bind_rnn(ins, outs, scratch, attrs) -> Bound:
    (steps, batch, _), hid = ins[0].shape, outs[0].shape[2]
    g, i = ins[1].shape
    f32 = scratch.view(np.float32)
    plan = rnn_scratch_floats(attrs["cell"], steps, batch, hid)
    rt = f32[plan : plan + hid * g].reshape(hid, g)
    specs = [None if a is None else (a.shape, "f32") for a in ins]
    in_loop = _rnn_variant(specs, [o.shape for o in outs], attrs) == "in_loop"
    wt = f32[plan + hid * g :][: g * i].reshape(i, g) if in_loop else rt[:0]

    def recur(x2, w, b, gx, r, rbh, h0, c0, y, gates, c, tmp, hb, *flags):
        ro = [_readonly(a) for a in (x2, w, b)] + [gx] + [_readonly(a) for a in (r, rbh, h0, c0)]
        args = (*ro, y, gates, c, tmp, hb, rt, wt, *flags, int(in_loop))
        kern, args = _bound(K.rnn_recur, args)
        return (lambda: kern(*args)), in_loop

    return lend_cores(rnn_step(np, ins, outs[0], f32[:plan], attrs, recur))  # BLAS GEMMs


def _bind_argmax(ins, outs, scratch, attrs) -> Bound:
    return G.argmax_step(np, ins[0], outs[0], attrs)


def _bind_slice(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    at = slice_block(x.shape, attrs)
    if at is not None and y.ctypes.data == x.ctypes.data + at * x.itemsize:
        return None  # the memory plan made y that block of x (packager/plan.py)
    return G.slice_step(np, x, y, attrs)  # a strided view, copied each run


def _bind_generic(op: str):
    """The dtype-generic ops (kernels/generic.py) over NumPy."""

    def bind(ins, outs, scratch, attrs) -> Bound:
        return G.generic_step(np, op, ins, outs[0], attrs)

    return bind


def _bind_concat(ins, outs, scratch, attrs) -> Bound:
    y = outs[0]
    ax = attrs["axis"] % y.ndim
    parts, start = [], 0
    for x in ins:
        idx = [slice(None)] * y.ndim
        idx[ax] = slice(start, start + x.shape[ax])
        parts.append((y[tuple(idx)], x))
        start += x.shape[ax]

    def step() -> None:
        for dst, src in parts:
            np.copyto(dst, src)

    return step


def _bind_reduce_mean(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    axes = tuple(a % x.ndim for a in attrs["axes"])
    inv = np.float32(y.size / x.size)
    y_kd = y.reshape([1 if i in axes else d for i, d in enumerate(x.shape)])

    def step() -> None:
        np.add.reduce(x, axis=axes, keepdims=True, out=y_kd)
        np.multiply(y_kd, inv, out=y_kd)

    return step


def _bind_pad(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    r = x.ndim
    p = attrs["pads"]
    inner = y[tuple(slice(p[i], p[i] + x.shape[i]) for i in range(r))]
    value = np.float32(attrs.get("value", 0.0))

    def step() -> None:
        y.fill(value)
        np.copyto(inner, x)

    return step


# --- mbconv: pointwise -> depthwise -> pointwise, in bands of output rows -----------
# Two variants. "rows": one gemm_tiles.mbconv_rows call a step, each worker its share of
# the output rows in bands through its own E and D slots (qmbconv's scheme, qmb.py): a
# 3x3 depthwise conv and one weight type (abi.MBCONV_ROWS_TYPES). Bound as three kernels
# a band, MobileNetV2's largest fp32 chains ran 1.29-1.39x faster at 2 threads than at
# 1 (Conv_3..5: 0.888 -> 0.665 ms), its int8 chains in one region 1.5-1.6x. "bands":
# the three kernels a band, every one split across the threads: other windows and
# weight mixes.


def _mbconv_variant(ins, outs, attrs) -> str:
    a = _args("mbconv", ins)
    if tuple(a.wd[0][:2]) != (3, 3):
        return "bands"
    pw = {spec[1] for spec in (a.we, a.wp) if spec is not None}
    dw = a.wd[1] if a.wd[1] in _READ_IN_PLACE else "f32"  # others widen first
    return "rows" if len(pw) == 1 and (pw.pop(), dw) in MBCONV_ROWS_TYPES else "bands"


def _mbconv_slots(specs: Sequence[Spec | None], y_shape, attrs: dict) -> list:
    """(name, float32 shape) of each scratch buffer, in order: the depthwise weights
    widened (fp16, bf16), the slab buffers of non-float32 pointwise panels (gemmp; the
    expand and project products take turns with them), then the expanded rows (E) and
    the depthwise output (D) of one band: one slot of each ("bands"), or one a worker
    ("rows", GEMM_SLOTS; slot first). Scratch and bind both lay scratch out from this
    list."""
    a = _args("mbconv", specs)
    _, h, w, _ = a.x[0]
    kh, _, _, ce = a.wd[0]
    _, oh, ow, _ = y_shape
    rows = min(int(attrs["band"]), oh)
    slots = (GEMM_SLOTS,) if _mbconv_variant(specs, [y_shape], attrs) == "rows" else ()
    out = []
    if a.wd[1] not in _READ_IN_PLACE:  # int8 depthwise weights widen in-kernel
        out.append(("wd", tuple(a.wd[0])))
    if any(spec is not None and spec[1] != "f32" for spec in (a.we, a.wp)):
        out.append(("slabs", (GEMM_SLOTS, GEMMP_SLAB_FLOATS)))
    if a.we is not None:
        out.append(("e", (*slots, min(h, mbconv.dw_rows_in(rows, attrs["dw"], kh)), w, ce)))
    out.append(("d", (*slots, rows, ow, ce)))
    return out


def _mbconv_scratch(ins, outs, attrs) -> int:
    return sum(up64(_nbytes(shape)) for _, shape in _mbconv_slots(ins, outs[0], attrs))


def _bind_mbconv(ins, outs, scratch, attrs) -> Bound:
    a = _args("mbconv", ins)
    x, y, res = a.x, outs[0], a.residual
    specs = [None if t is None else (tuple(t.shape), wtypes.of_array(t)) for t in a]
    views, offs, off = {}, {}, 0
    for name, shape in _mbconv_slots(specs, y.shape, attrs):
        views[name], offs[name] = _f32_slot(scratch, off, shape)[0], off
        off += up64(_nbytes(shape))
    for name, sub in (("expand", attrs.get("expand")), ("project", attrs["project"])):
        if sub is not None and sub.get("panel") != PANEL:
            raise ValueError(f"mbconv: the {name} conv's weights must be {PANEL}-wide panels")
    if _mbconv_variant(specs, [y.shape], attrs) == "rows":
        return _bind_mbconv_rows(a, y, views, scratch, offs, attrs)
    decodes = []

    def widened(w: np.ndarray, name: str) -> np.ndarray:
        if name not in views:
            return w
        decodes.append(_decoder(w, views[name]))
        return views[name]

    def pointwise(w: np.ndarray) -> tuple:
        """(panels, slab buffers, workers): gemmp's weight arguments."""
        return _panel_operands(w, scratch, offs.get("slabs", 0))

    def epilogue(conv: list, r, sub: dict, cols: int = 0) -> tuple[tuple, tuple]:
        """((bias, scale), (flags, act, a, b)): the kernels' epilogue arguments."""
        bias, scale = conv[2], conv[3]
        bs = (bias if bias is not None else _DUMMY1, scale if scale is not None else _DUMMY1)
        return bs, (_flags(bias, scale, r) | cols, *_act(sub))

    expand, dwin, proj = mbconv.parts(a)
    if expand is not None:
        we, wbuf_e, workers_e = pointwise(expand[1])
        bs_e, fa_e = epilogue(expand, None, attrs["expand"], PER_COL)
    wd = widened(dwin[1], "wd")
    bs_d, fa_d = epilogue(dwin, None, attrs["dw"])
    wp, wbuf_p, workers_p = pointwise(proj[1])
    bs_p, fa_p = epilogue(proj, res, attrs["project"], PER_COL)
    da = attrs["dw"]
    sh, sw = da["strides"]
    pt, pl, _, _ = da["pads"]
    dh, dw = da["dilations"]
    kh = dwin[1].shape[0]
    n_, h, _, ci = x.shape
    _, oh, _, co = y.shape
    ce = dwin[1].shape[3]
    band = min(int(attrs["band"]), oh)
    # per band, the arguments of its kernel calls: the expanded rows it shares with the
    # band before (the depthwise window's overlap) carried over rather than expanded
    # again (a copy costs a fifth of their GEMM; 14x14 in bands of 11 + 3 rows expanded
    # 16 rows), then expand (none without one), depthwise, project
    calls = []
    for n in range(n_):
        prev = None  # the band before's expanded rows [lo, hi), this image
        for oy0 in range(0, oh, band):
            r = min(band, oh - oy0)
            lo = max(0, oy0 * sh - pt)  # first image row the band's depthwise taps read
            hi = min(h, oy0 * sh - pt + mbconv.dw_rows_in(r, da, kh))
            d = views["d"][:r]
            yb = y[n, oy0 : oy0 + r].reshape(-1, co)
            rb = _DUMMY2 if res is None else res[n, oy0 : oy0 + r].reshape(-1, co)
            carry = None
            if expand is None:
                e, ex = x[n, lo:hi], None
            else:
                e = views["e"][: hi - lo]
                kept = 0 if prev is None else max(0, prev[1] - lo)
                if kept and lo - prev[0] >= kept:  # source and destination rows apart
                    src = views["e"][lo - prev[0] : prev[1] - prev[0]]
                    carry = (src, e[:kept])
                else:
                    kept = 0
                xin = _readonly(x[n, lo + kept : hi].reshape(-1, ci))
                eo = e[kept:].reshape(-1, ce)
                ex = (xin, _NOROWS, ci, 1, 0, we, eo, *bs_e, _DUMMY2, *fa_e, workers_e, wbuf_e)
                prev = (lo, hi)
            ptb = lo + pt - oy0 * sh  # the band's own top pad
            dwa = (e, wd, *bs_d, _DUMMY3, d, sh, sw, ptb, pl, dh, dw, *fa_d)
            pr = (
                _readonly(d.reshape(-1, ce)),
                _NOROWS,
                ce,
                1,
                0,
                wp,
                yb,
                *bs_p,
                rb,
                *fa_p,
                workers_p,
                wbuf_p,
            )
            calls.append((carry, ex, dwa, pr))
    dw = _dw_kernel(_dw_path(dwin[1].shape, None, da))  # channels-last: no planes
    calls = [
        (carry, ex and _bound(K.gemmp, ex), _bound(dw, d), _bound(K.gemmp, p))
        for carry, ex, d, p in calls
    ]
    copyto = np.copyto

    def step() -> None:
        for decode in decodes:
            decode()
        for carry, ex, (dwk, dwa), (gemmp, pr) in calls:
            if carry is not None:
                copyto(carry[1], carry[0])
            if ex is not None:
                ex[0](*ex[1])
            dwk(*dwa)
            gemmp(*pr)

    return step


def _bind_mbconv_rows(a, y: np.ndarray, views: dict, scratch, offs: dict, attrs) -> Bound:
    """One gemm_tiles.mbconv_rows call a step (the "rows" variant), after the depthwise
    weights are widened (fp16, bf16)."""
    expand, dwin, proj = mbconv.parts(a)
    wd, decodes = dwin[1], []
    if "wd" in views:
        decodes.append(_decoder(wd, views["wd"]))
        wd = views["wd"]
    wp, wbuf, _ = _panel_operands(proj[1], scratch, offs.get("slabs", 0))
    if expand is None:  # no expand conv: empty panels of the projection's type
        we, fe = wp[:0], (_DUMMY1, _DUMMY1, 0, 0, np.float32(0), np.float32(0))
    else:
        we = _panel_operands(expand[1], scratch, offs.get("slabs", 0))[0]
        fe = (_some(expand[2]), _some(expand[3]), _flags(expand[2], expand[3], None) | PER_COL,
              *_act(attrs["expand"]))  # fmt: skip
    da, res = attrs["dw"], proj[4]
    (sh, sw), (dh, dw), (pt, pl) = da["strides"], da["dilations"], da["pads"][:2]
    act_d = _act(da)
    co = y.shape[3]
    workers = max(1, min(GEMM_SLOTS, kernel_threads()))
    ebuf = views["e"][:workers] if "e" in views else _EMPTY_E
    args = (
        _readonly(a.x), expand is not None, we, *fe,
        wd, _some(dwin[2]), _some(dwin[3]), _flags(dwin[2], dwin[3], None),
        sh, sw, pt, pl, dh, dw, *act_d,
        wp, y.reshape(-1, co), _some(proj[2]), _some(proj[3]),
        _readonly(_DUMMY2 if res is None else res.reshape(-1, co)),
        _flags(proj[2], proj[3], res) | PER_COL, *_act(attrs["project"]),
        min(int(attrs["band"]), y.shape[1]), ebuf, views["d"][:workers], wbuf,
    )  # fmt: skip
    fn, fa = _bound(K.mbconv_rows, args)

    def step() -> None:
        for decode in decodes:
            decode()
        fn(*fa)

    return step


def _some(v: np.ndarray | None) -> np.ndarray:
    return _DUMMY1 if v is None else v


# --- qmbconv: the int8 chain, a band per thread (qmb.py) -----------------------------
# Scratch, 64-byte aligned pieces: the input's u8 codes when they cannot be read in
# place (float32 input, or channels not a multiple of 4), then per slot (GEMM_SLOTS: a
# worker each) E rows for one band (float32), D rows for one band (u8 codes, with the
# slack the projection's runs of 4 read past the last pixel), and qgemm's scratch row.
# Four slots of the packager's band (at most QBAND_BYTES of E plus D) each: MobileNetV2's
# largest chain takes 5.1 MB, its unfused 112x112x96 E alone was 4.8 MB.


def _qmbconv_plan(x_shape, x_codes: bool, y_shape, attrs: dict) -> tuple:
    """(band rows, input read in place, E's slots shape, D's bytes a slot, the input
    codes' bytes, 0 in place) of a qmbconv node whose input is u8 codes or float32."""
    n_, h, w, c = x_shape
    _, oh, ow, _ = y_shape
    ce, da = int(attrs["expand"]["out_channels"]), attrs["dw"]
    band = min(int(attrs["band"]), oh)
    e_rows = min(h, mbconv.dw_rows_in(band, da, 3))
    in_place = x_codes and c % 4 == 0
    codes = 0 if in_place else n_ * h * w * c + QGEMM_SLACK
    return band, in_place, (GEMM_SLOTS, e_rows, w, ce), band * ow * ce + QGEMM_SLACK, codes


def _qmbconv_scratch(ins, outs, attrs) -> int:
    _, _, e_shape, d_bytes, codes = _qmbconv_plan(ins[0][0], ins[0][1] == "u8", outs[0], attrs)
    return (up64(codes) + up64(_nbytes(e_shape)) + GEMM_SLOTS * up64(d_bytes)
            + _nbytes(_qgemm_scratch_shape(), 8))  # fmt: skip


def _bind_qmbconv(ins, outs, scratch, attrs) -> Bound:
    """One qmb.qmbconv_rows call a step: each worker its share of the output rows, in
    bands through its own E and D slots (the module doc of qmb.py has why)."""
    expand, dwin, proj = mbconv.qparts(ins)
    x, y, res = expand[0], outs[0], proj[4]
    if tuple(dwin[1].shape[:2]) != (3, 3):
        raise ValueError(f"qmbconv: 3x3 depthwise weights, not {dwin[1].shape}")
    n_, h, w, c = x.shape
    _, oh, ow, co = y.shape
    ea, da, pa = attrs["expand"], attrs["dw"], mbconv.q_project_attrs(attrs)
    band, in_place, e_shape, d_bytes, codes = _qmbconv_plan(
        x.shape, x.dtype == np.uint8, y.shape, attrs)
    off = up64(codes)
    ebuf = _f32_slot(scratch, off, e_shape)[0]
    off += up64(_nbytes(e_shape))
    dstride = up64(d_bytes)
    dbuf = scratch[off : off + GEMM_SLOTS * dstride].reshape(GEMM_SLOTS, dstride)
    off += GEMM_SLOTS * dstride
    workers = max(1, min(GEMM_SLOTS, kernel_threads()))
    qs = scratch[off : off + _nbytes(_qgemm_scratch_shape(), 8)]
    qs = qs.view(np.int64).reshape(_qgemm_scratch_shape())[:workers]
    img = h * w * c
    fills = []
    if in_place:
        xr = _readonly(x.reshape(-1))
    else:  # the input's codes, every image, then the slack its last runs read
        xq = scratch[:codes]
        s, z = np.float32(ea["x_scale"]), int(ea["x_zero"])
        fills = [_bound(K.quantize_pad_nhwc, (x[n], xq[n * img :], h, w, 0, 0, 1, 1, s, z))
                 for n in range(n_)]  # fmt: skip
        xr = _readonly(xq)
    rtab = _readonly(np.arange(h * w, dtype=np.int64) * c)
    ptab = _readonly(np.arange(band * ow, dtype=np.int64) * dwin[1].shape[3])
    act_e, a_e, b_e = _act(ea)
    act_d, a_d, b_d = _act(da)
    if act_d not in (0, 1, 3):
        raise ValueError(f"qmbconv: the depthwise conv clamps (relu, clip), not {da.get('act')}")
    yinv_d, yz_d = _y_codes(da, dbuf)
    act_p, a_p, b_p = _act(pa)
    yinv_p, yz_p = _y_codes(pa, y)
    (sh, sw), (dh, dw), (pt, pl) = da["strides"], da["dilations"], da["pads"][:2]

    r2 = _DUMMY2 if res is None else res.reshape(-1, co)
    args = (
        xr, rtab, img, int(ea["run4"]), _readonly(expand[1].reshape(-1)), expand[5],
        _some(expand[2]), expand[3], _flags(expand[2], None, None), act_e, a_e, b_e,
        dwin[1], _some(dwin[2]), dwin[3], _flags(dwin[2], None, None), sh, sw, pt, pl, dh, dw,
        act_d, a_d, b_d, yinv_d, yz_d,
        int(pa["run4"]), _readonly(proj[1].reshape(-1)), proj[5], y.reshape(-1, co),
        _some(proj[2]), proj[3], r2, _flags(proj[2], None, res), act_p, a_p, b_p, yinv_p, yz_p,
        n_, oh, ow, band, ebuf[:workers], dbuf[:workers], ptab, qs,
    )  # fmt: skip
    fn, a_ = _bound(K.qmbconv_rows, args)

    def step() -> None:
        for f, fa in fills:
            f(*fa)
        fn(*a_)

    return step


def _cpu(op: str, bind, dtypes=("f32",), scratch=None, accepts=None, variant=None) -> None:
    scratch = scratch or (lambda i, o, a: 0)
    k = Kernel(f"cpu.{op}", bind, scratch, accepts or (lambda a: True))
    if variant is not None:
        k = Kernel(k.name, k.bind, k.scratch, k.accepts, variant)
    register(op, dtypes, "cpu", k)


# Weight types every weight op takes through the binds above (float32 or a decoder);
# int4 has kernels of its own (below).
_ALL_W = tuple(r.name for r in wtypes.ROWS if r.decoders.get("cpu", "") != "own")


def _conv_takes(attrs: dict) -> bool:
    # channels-last only with group 1 and panels (packager/layout.py)
    return not layout.is_nhwc(attrs) or (attrs.get("group", 1) == 1 and attrs.get("panel") == PANEL)


_cpu("conv", _bind_conv, _ALL_W, _conv_scratch, accepts=_conv_takes, variant=_conv_variant)
_cpu("dwconv", _bind_dwconv, _ALL_W, _dw_scratch, variant=_dw_variant)
_cpu("conv_wino", _bind_conv_wino, winograd.WEIGHT_TYPES, _wino_scratch)
_cpu("qconv", _bind_qconv, ("i8",), _qconv_scratch)
_cpu("qdwconv", _bind_qdwconv, ("f32", "i8"))
# every weight dtype, and mixes of them (the registry keys fused nodes as f32)
_cpu("mbconv", _bind_mbconv, ("f32",), _mbconv_scratch, variant=_mbconv_variant)
_cpu("qmbconv", _bind_qmbconv, ("f32",), _qmbconv_scratch)
# float activations only: a node with xq (int8 activations) falls to a kernel that has them
_cpu("linear", _bind_linear, tuple(t for t in _ALL_W if t != "i8"), _linear_scratch,
     lambda a: not a.get("xq"), _linear_variant)  # fmt: skip


# int8 weights: as the others, or with int8 activations (xq) on weights the packager
# interleaved by 16 rows (q8x16.py; packager/layout.py interleave_rows)
def _i8_linear_variant(ins, outs, attrs) -> str:
    return "gemm_q8x16_q8" if attrs.get("xq") else _linear_variant(ins, outs, attrs)


def _i8_linear_scratch(ins, outs, attrs) -> int:
    if attrs.get("xq"):
        return xq_scratch_layout(_q4_rows(ins[0][0]), ins[1][0][1])[1]
    return _linear_scratch(ins, outs, attrs)


def _bind_i8_linear(ins, outs, scratch, attrs) -> Bound:
    if not attrs.get("xq"):
        return _bind_linear(ins, outs, scratch, attrs)
    io = _args("linear", ins)
    x2 = _readonly(io.x.reshape(-1, io.x.shape[-1]))
    y2 = outs[0].reshape(-1, io.w.shape[0])
    xq, nc, sx = xq_scratch_views(scratch, x2.shape[0], io.w.shape[1])
    b_ = io.bias if io.bias is not None else _DUMMY1
    args = (x2, io.w, io.scale, b_, y2, xq, nc, sx, _flags(io.bias, None, None), *_act(attrs))
    kern, args = _bound(K.gemm_q8x16_q8, args)
    return lambda: kern(*args)


def _i8_linear_takes(attrs: dict) -> bool:
    return not attrs.get("xq") or (
        attrs["xq"] == XQ_BLOCK and attrs.get("interleave") == layout.Q4_INTERLEAVE
    )


_cpu("linear", _bind_i8_linear, ("i8",), _i8_linear_scratch, _i8_linear_takes,
     _i8_linear_variant)  # fmt: skip
_cpu("matmul", _bind_matmul)
_cpu("binary", _bind_binary)
_cpu("unary", _bind_unary)
_cpu("slice", _bind_slice)
_cpu("argmax", _bind_argmax)
_cpu("reduce", _bind_reduce, scratch=_reduce_scratch)
_cpu("rnn", _bind_rnn, scratch=_rnn_scratch, variant=_rnn_variant)
for _op in G.STEP_OPS:
    _cpu(_op, _bind_generic(_op))
_cpu("resample", _bind_resample)
_cpu("conv_transpose", _bind_conv_transpose, scratch=_conv_transpose_scratch)
_cpu("math", _bind_math)
_cpu("softmax", _bind_softmax)
_cpu("sdpa", _bind_sdpa, scratch=_sdpa_scratch)
_cpu("maxpool", _bind_pool("max"))
_cpu("avgpool", _bind_pool("avg"))
_cpu("global_avgpool", _bind_global_avgpool)
_cpu("channel_affine", _bind_channel_affine)
_cpu("reshape", _bind_reshape)
_cpu("transpose", _bind_transpose)
_cpu("concat", _bind_concat)
_cpu("rows", _bind_rows)
_cpu("reduce_mean", _bind_reduce_mean)
# Pad: constant mode only on this backend; reflect/edge pads run on the reference
# kernel (the packager records that choice in the bundle).
_cpu("pad", _bind_pad, accepts=lambda a: a.get("mode", "constant") == "constant")


# --- int4 weights (stored canonical, kernels/decoded.py) ----------------------------

# Rows of x up to which an int4 linear runs the fused GEMV (gemm_tiles.gemv_q4: the
# packed weights stream once per row, never widened); above, they are decoded once a
# run into scratch and BLAS takes the product, as for fp16. The GEMV's time grows with
# the rows, the decode's does not: 1 thread, GEMV / decode+BLAS ms at 1536x576 were
# 0.95 / 1.53 at 16 rows and 1.92 / 1.79 at 32; at 4096x4096 16.9 / 32.5 and 33.1 / 38.3.
Q4_GEMV_MAX_ROWS = 32


def _q4_decode(w, scale, dst, rows, cols):
    kern, args = _bound(
        K.decode_q4, (w, _readonly(scale.view(np.uint16)), dst, _readonly(rows), _readonly(cols))
    )
    return lambda: kern(*args)


_q4_conv = decoded(
    "conv",
    Kernel("cpu.conv", _bind_conv, _conv_scratch, variant=_conv_variant),
    _q4_decode,
    _f32_slot,
    "cpu.conv.i4",
)
_q4_linear_decoded = decoded(
    "linear",
    Kernel("cpu.linear", _bind_linear, _linear_scratch, variant=_linear_variant),
    _q4_decode,
    _f32_slot,
    "cpu.linear.i4",
)


def _q4_rows(x_shape: Sequence[int]) -> int:
    return int(np.prod(x_shape[:-1], dtype=np.int64))


def _xq_kernel(attrs: dict) -> str:
    """int8 activations: integer dot products at any row count, on weights interleaved
    by 16 rows where the packager stored them so (q4x16.py)."""
    return "gemm_q4x16_q8" if attrs.get("interleave") else "gemv_q4_q8"


def _q4_linear_variant(ins, outs, attrs) -> str:
    if attrs.get("xq"):
        return _xq_kernel(attrs)
    if _q4_rows(ins[0][0]) <= Q4_GEMV_MAX_ROWS:
        return "gemv_q4"
    return _q4_linear_decoded.variant(ins, outs, attrs)


def _q4_linear_scratch(ins, outs, attrs) -> int:
    variant = _q4_linear_variant(ins, outs, attrs)
    if variant in ("gemv_q4_q8", "gemm_q4x16_q8"):  # the same quantized rows' scratch
        return xq_scratch_layout(_q4_rows(ins[0][0]), ins[1][0][1] * 2)[1]
    if variant == "gemv_q4":
        return 0
    return _q4_linear_decoded.scratch(ins, outs, attrs)


def _bind_q4_linear(ins, outs, scratch, attrs) -> Bound:
    io = _args("linear", ins)
    x, w, bias, scale = io.x, io.w, io.bias, io.scale
    if attrs.get("xq"):
        return _bind_q4_q8_linear(x, w, bias, scale, outs[0], scratch, attrs)
    if _q4_rows(x.shape) > Q4_GEMV_MAX_ROWS:  # _q4_linear_variant's rule
        return _q4_linear_decoded.bind(ins, outs, scratch, attrs)
    y = outs[0]
    x2 = _readonly(x.reshape(-1, x.shape[-1]))
    y2 = y.reshape(-1, w.shape[0])
    b_ = bias if bias is not None else _DUMMY1
    flags = _flags(bias, None, None)
    kern, args = _bound(
        K.gemv_q4, (x2, w, _readonly(scale.view(np.uint16)), b_, y2, flags, *_act(attrs))
    )
    return lambda: kern(*args)


def _bind_q4_q8_linear(x, w, bias, scale, y, scratch, attrs) -> Bound:
    x2 = _readonly(x.reshape(-1, x.shape[-1]))
    y2 = y.reshape(-1, w.shape[0])
    xq, nc, sx = xq_scratch_views(scratch, x2.shape[0], w.shape[1] * 2)
    b_ = bias if bias is not None else _DUMMY1
    flags = _flags(bias, None, None)
    args = (x2, w, _readonly(scale.view(np.uint16)), b_, y2, xq, nc, sx, flags, *_act(attrs))
    kern, args = _bound(getattr(K, _xq_kernel(attrs)), args)
    return lambda: kern(*args)


def _q4_linear_takes(attrs: dict) -> bool:
    return attrs.get("xq", 0) in (0, XQ_BLOCK)


_cpu("conv", _q4_conv.bind, ("i4",), _q4_conv.scratch, _conv_takes, _q4_conv.variant)
_cpu("linear", _bind_q4_linear, ("i4",), _q4_linear_scratch, _q4_linear_takes,
     _q4_linear_variant)  # fmt: skip


# --- decoder-LLM ops (kernels/cpu/llm.py) --------------------------------------------


def _rows2(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


def _bind_norm(ins, outs, scratch, attrs) -> Bound:
    io = _args("norm", ins)
    b = io.b if io.b is not None else _DUMMY1
    call = (_rows2(io.x), io.w, b, _rows2(outs[0]), float(attrs["eps"]))
    flags = (attrs["kind"] == "layer", io.b is not None, norm_group(io.x.shape, attrs))
    kern, args = _bound(K.norm_rows, (*call, *flags))
    return lambda: kern(*args)


def _bind_rope(ins, outs, scratch, attrs) -> Bound:
    io = _args("rope", ins)
    call = (io.x, io.pos, io.cos, io.sin, outs[0], int(attrs["heads"]), int(attrs["head_dim"]))
    kern, args = _bound(K.rope_rows, call)
    return lambda: kern(*args)


def _bind_glu(ins, outs, scratch, attrs) -> Bound:
    # the gate's code is its place in ops.GATE_ACTS (llm.glu_rows); not imported from
    # kernels/cpu/llm.py, which needs numba: AOT executables have none
    code = GATE_ACTS.index(attrs["act"])
    kern, args = _bound(K.glu_rows, (_rows2(ins[0]), _rows2(outs[0]), code))
    return lambda: kern(*args)


def _bind_embed(ins, outs, scratch, attrs) -> Bound:
    io = _args("embed", ins)
    ids, y, mul = io.ids.reshape(-1), _rows2(outs[0]), float(attrs.get("mul", 1.0))
    if io.w.itemsize == 2:  # fp16 (numba has no CPU float16: its bits) or bf16 bits
        call = (ids, io.w.view(np.uint16), y, y.view(np.uint32), mul, io.w.dtype != np.float16)
        kern, args = _bound(K.embed_rows_half, call)
        return lambda: kern(*args)
    scale = io.scale if io.scale is not None else _DUMMY1
    x16 = bool(attrs.get("interleave"))  # a tied int8 table the output projection reads
    kern, args = _bound(K.embed_rows, (ids, io.w, scale, y, mul, io.scale is not None, x16))
    return lambda: kern(*args)


def _attention_group(attrs) -> int:
    return int(attrs["heads"]) // int(attrs["kv_heads"])


# Workers of the attention (llm.attention_rows): each takes (row, kv head) tasks with
# its own scores and sums. Serial, SmolLM2's 8-row decode step spent 4.1 ms of its 31
# in attention on one of two cores, a 32-token prompt chunk 12 ms.
ATTENTION_SLOTS = 4


def _attention_layout(n: int, g: int, ctx: int, hd: int) -> tuple[int, int]:
    """(offset of the sums, bytes) of n workers' scratch: the scores over the cache,
    then the weighted sums of the query heads one kv head serves (float32)."""
    return up64(4 * n * g * ctx), up64(4 * n * g * ctx) + up64(4 * n * g * hd)


def _attention_scratch(ins, outs, attrs) -> int:
    ctx = _args("attention", ins).k_cache[0][1]
    g, hd = _attention_group(attrs), int(attrs["head_dim"])
    return _attention_layout(ATTENTION_SLOTS, g, ctx, hd)[1]


def _bind_attention(ins, outs, scratch, attrs) -> Bound:
    io = _args("attention", ins)
    kc, vc = io.k_cache, io.v_cache
    half = kc.dtype == np.float16
    if half:  # numba has no CPU float16: the caches' bits
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    ctx, hd, g = kc.shape[1], int(attrs["head_dim"]), _attention_group(attrs)
    # as many workers as threads run and the planned scratch holds (a bundle planned
    # before workers holds one)
    n = max(1, min(ATTENTION_SLOTS, kernel_threads()))
    while n > 1 and _attention_layout(n, g, ctx, hd)[1] > scratch.nbytes:
        n -= 1
    off = _attention_layout(n, g, ctx, hd)[0]
    sc = scratch[: 4 * n * g * ctx].view(np.float32)
    acc = scratch[off : off + 4 * n * g * hd].view(np.float32)
    call = (
        io.qkv, io.qkv.view(np.uint32), io.pos, io.slot, kc, vc, outs[0], sc, acc,
        int(attrs["heads"]), int(attrs["kv_heads"]), hd, float(attrs["scale"]),
        int(attrs["window"]), float(attrs.get("softcap", 0.0)), half,
    )  # fmt: skip
    kern, args = _bound(K.attention_rows, call)
    return lambda: kern(*args)


_cpu("norm", _bind_norm)
_cpu("rope", _bind_rope)
_cpu("glu", _bind_glu)
_cpu("embed", _bind_embed, ("f32", "i8", "f16", "bf16"))
_cpu("attention", _bind_attention, scratch=_attention_scratch)
