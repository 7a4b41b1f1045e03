"""Channels-last (NHWC) nodes: what the ``layout`` attribute means, and how a backend
that only computes channels-first runs such a node.

The packager decides the layout (packager/layout.py): on CPU targets, conv-like ops
read and write ``[N, H, W, C]`` activations so that channels are the contiguous,
vectorised axis (a depthwise conv or a 1x1 conv on a 7x7 image fills whole vectors;
planar, a 7x7 plane wastes a quarter of each 16-lane vector). A node with
``attrs["layout"] == "nhwc"`` has:

- activation input 0, the residual (input 4 of the conv ops) and output 0 in
  ``[N, H, W, C]``, except ``global_avgpool``, whose ``[N, C, 1, 1]`` output has the
  same bytes either way and stays channels-first;
- ``dwconv`` weights in ``[kh, kw, 1, C]`` (HWIO); ``conv`` weights (group 1) in
  panels ``[ceil(Co/64), kh, kw, C, 64]`` (attributes ``panel`` = 64 and
  ``out_channels`` = Co; ``to_panels``):
  the HWIO matrix ``[kh*kw*C, Co]`` (row k one input tap, columns the output
  channels) cut into blocks of 64 columns, each stored whole, zero past Co. The CPU
  GEMM streams a panel front to back without repacking it per call;
  ``conv_wino`` weights unchanged (``U[a*a, C, Co]`` is already channels-last).

The reference and CUDA backends compute these nodes channels-first through
``adapt``: transposed copies of the activations, the weights permuted back once at
bind time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .binding import nbytes, up64
from .ops import role

# Columns per panel of pre-packed GEMM weights (kernels/layout.py to_panels): a
# multiple of every tile shape's width (64 for AVX-512, 16 for AVX2 and NEON, 8 for SSE).
PANEL = 64
NHWC = "nhwc"
TO_NCHW = (0, 3, 1, 2)
TO_NHWC = (0, 2, 3, 1)
HWIO_FROM_OIHW = (2, 3, 1, 0)
OIHW_FROM_HWIO = (3, 2, 0, 1)
# Ops with a channels-last form, and which of their inputs are activations.
LAYOUT_OPS = ("conv", "dwconv", "conv_wino", "maxpool", "global_avgpool")
WEIGHT_IN_HWIO = ("conv", "dwconv")


def is_nhwc(attrs: dict) -> bool:
    return attrs.get("layout") == NHWC


def to_panels(hwio: np.ndarray) -> np.ndarray:
    """HWIO weights ``[kh, kw, C, Co]`` -> panels ``[ceil(Co/PANEL), kh, kw, C, PANEL]``
    (numpy; the packager's side)."""
    kh, kw, c, co = hwio.shape
    n = -(-co // PANEL)
    padded = np.zeros((kh, kw, c, n * PANEL), hwio.dtype)
    padded[..., :co] = hwio
    return np.ascontiguousarray(padded.reshape(kh, kw, c, n, PANEL).transpose(3, 0, 1, 2, 4))


def from_panels(p, co: int):
    """Panels back to HWIO ``[kh, kw, C, Co]`` (a copy; array methods only, so numpy
    or cupy)."""
    n, kh, kw, c, width = p.shape
    return p.transpose(1, 2, 3, 0, 4).reshape(kh, kw, c, n * width)[..., :co]


def hwio_weights(w, attrs: dict):
    """A channels-last conv's weights as HWIO, whether stored so or in panels."""
    return from_panels(w, attrs["out_channels"]) if attrs.get("panel") else w


def node_weight_shape(op: str, wshape: Sequence[int], attrs: dict) -> tuple[int, ...]:
    """The float32 weight shape a node of ``op`` computes with, for logical (OIHW, or
    linear's [N, K]) weights ``wshape``: HWIO or panels when channels-last."""
    wshape = tuple(int(d) for d in wshape)
    if op not in WEIGHT_IN_HWIO or not is_nhwc(attrs):
        return wshape
    co, cg, kh, kw = wshape
    if attrs.get("panel"):
        return (-(-co // PANEL), kh, kw, cg, PANEL)
    return (kh, kw, cg, co)


def weight_offsets(op: str, wshape: Sequence[int], attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    """(row[N], col[K]) int64: weight (n, k) of the canonical [N, K] matrix (row n an
    output channel, k its reduction index in OIHW order) lives at flat offset
    row[n] + col[k] of the node's float32 weights (``node_weight_shape``). Backends
    decode weights stored canonical (int4) straight into the layout the node runs in."""
    n = int(wshape[0])
    k = int(np.prod(wshape[1:], dtype=np.int64))
    rows, cols = np.arange(n, dtype=np.int64), np.arange(k, dtype=np.int64)
    if op not in WEIGHT_IN_HWIO or not is_nhwc(attrs):
        return rows * k, cols
    _, cg, kh, kw = wshape
    c, rest = np.divmod(cols, kh * kw)
    tap = rest * cg + c  # (i * kw + j) * C + c: the HWIO row of reduction index k
    if attrs.get("panel"):
        panel = kh * kw * cg * PANEL
        return (rows // PANEL) * panel + rows % PANEL, tap * PANEL
    return rows, tap * n


def window(w_shape: Sequence[int], attrs: dict) -> tuple[int, int]:
    """(kh, kw) of a channels-last conv's weights from their stored shape alone (HWIO
    or panels): no need to unpack panels to look at them."""
    return tuple(w_shape[1:3]) if attrs.get("panel") else tuple(w_shape[:2])


def hwio_shape(panels_shape: Sequence[int], co: int) -> tuple[int, ...]:
    _, kh, kw, c, _ = panels_shape
    return (kh, kw, c, co)


def nchw(shape: Sequence[int]) -> tuple[int, ...]:
    """The channels-first shape of a channels-last ``[N, H, W, C]`` shape."""
    n, h, w, c = shape
    return (n, c, h, w)


def output_is_nhwc(op: str) -> bool:
    return op != "global_avgpool"


def activation_inputs(op: str, n_inputs: int) -> list[int]:
    """Indices of a channels-last node's inputs held in ``[N, H, W, C]``."""
    if op in ("maxpool", "global_avgpool"):
        return [0]
    res = role(op, "residual")  # conv, dwconv, conv_wino
    return [0] + ([res] if n_inputs > res else [])


def canonical_weights(attrs: dict) -> bool:
    """True when the node's weights are stored canonical whatever its layout (int4:
    kernels/wtypes.py; ``wshape`` is their logical shape)."""
    return "wshape" in attrs


def channels_first_attrs(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if k not in ("layout", "panel", "out_channels")}


def adapt(
    op: str,
    bind,
    scratch_fn,
    slot: Callable[[Any, int, tuple[int, ...]], tuple[Any, int]],
    copier: Callable[[Any, Any], Callable[[], None]],
    contiguous: Callable[[Any], Any],
):
    """(bind, scratch) of a channels-first kernel extended to channels-last nodes.

    ``slot(scratch, offset, shape)`` -> (float32 view, next offset), ``copier(dst, src)``
    -> a step copying src into dst, and ``contiguous(a)`` are the backend's array
    operations. The transposed copies of
    the activations live in scratch after the kernel's own, so nothing is allocated
    per call; the permuted weights are copied once, when the node is bound.
    """

    def specs_first(ins, outs, attrs: dict):
        ins2 = list(ins)
        for i in activation_inputs(op, len(ins)):
            if i < len(ins2) and ins2[i] is not None:
                ins2[i] = (nchw(ins2[i][0]), ins2[i][1])
        if op in WEIGHT_IN_HWIO and ins2[1] is not None and not canonical_weights(attrs):
            shape = ins2[1][0]
            if attrs.get("panel"):
                shape = hwio_shape(shape, attrs["out_channels"])
            ins2[1] = (tuple(shape[j] for j in OIHW_FROM_HWIO), ins2[1][1])
        outs2 = [nchw(o) if output_is_nhwc(op) else o for o in outs]
        return ins2, outs2

    def copies(ins, outs) -> list[tuple[int, ...]]:
        shapes = [nchw(ins[i][0]) for i in activation_inputs(op, len(ins)) if ins[i] is not None]
        return shapes + ([nchw(outs[0])] if output_is_nhwc(op) else [])

    def scratch(ins, outs, attrs: dict) -> int:
        if not is_nhwc(attrs):
            return scratch_fn(ins, outs, attrs)
        ins2, outs2 = specs_first(ins, outs, attrs)
        own = up64(scratch_fn(ins2, outs2, channels_first_attrs(attrs)))
        return own + sum(up64(nbytes(s)) for s in copies(ins, outs))

    def bound(ins, outs, scr, attrs: dict):
        if not is_nhwc(attrs):
            return bind(ins, outs, scr, attrs)
        a2 = channels_first_attrs(attrs)
        specs = [None if a is None else (tuple(a.shape), dtype_name(a.dtype)) for a in ins]
        ins2s, outs2s = specs_first(specs, [o.shape for o in outs], attrs)
        off = up64(scratch_fn(ins2s, outs2s, a2))
        ins2 = list(ins)
        pre = []  # steps filling the channels-first copies
        for i in activation_inputs(op, len(ins)):
            if ins[i] is None:
                continue
            view, nxt = slot(scr, off, nchw(ins[i].shape))
            off = up64(nxt)
            pre.append(copier(view, ins[i].transpose(TO_NCHW)))
            ins2[i] = view
        if op in WEIGHT_IN_HWIO and not canonical_weights(attrs):
            ins2[1] = contiguous(hwio_weights(ins[1], attrs).transpose(OIHW_FROM_HWIO))
        out = outs[0]
        post = None
        if output_is_nhwc(op):
            first, _ = slot(scr, off, nchw(out.shape))
            post = copier(out, first.transpose(TO_NHWC))
            outs2 = [first]
        else:
            outs2 = list(outs)
        step = bind(ins2, outs2, scr, a2)

        def run() -> None:
            for copy in pre:
                copy()
            if step is not None:
                step()
            if post is not None:
                post()

        return run

    return bound, scratch


def dtype_name(dt) -> str:
    return {"float32": "f32", "float16": "f16", "int8": "i8"}.get(str(dt), str(dt))
