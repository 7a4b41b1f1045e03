"""``mbconv``: a pointwise -> depthwise -> pointwise conv chain run as one node
(MobileNet's inverted residual block; packager/mbconv.py forms it).

Unfused, the 6x-expanded tensor between the convs went to memory and back twice:
MobileNetV2's first blocks hold 2-5 MB there, more than L2. Fused, the cpu kernel runs
the chain in bands of output rows, so a band's expanded rows are still in cache when
the depthwise conv and the projection read them (docs/cpu-kernels.md, "Banded
chains").

Inputs, in order (absent optional ones ""): ``x, we, be, se`` (the expand conv:
activation, weights, bias, int8 scale; all absent for a chain without one),
``wd, bd, sd`` (the depthwise conv), ``wp, bp, sp`` (the projection), ``res`` (the
block's residual, added by the projection). Every activation and weight is in the
channels-last layout (kernels/layout.py). Attributes: ``expand`` (absent without one),
``dw`` and ``project`` hold the original convs' attributes; ``band`` the output rows
per band, chosen by the packager.

Here: splitting the inputs, the intermediate shapes, and ``composed``, which runs the
three convs one after the other on whole intermediates in scratch, from any backend's
kernels (the cuda backend uses it; the cpu one bands).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .binding import nbytes, up64
from .layout import dtype_name
from .ops import args


def parts(ins: Sequence) -> tuple[list | None, list, list]:
    """(expand, depthwise, projection) inputs of each conv (its x, w, bias, scale and,
    for the projection, the residual), with ``None`` standing for the activation each
    takes from the one before; expand is None without one."""
    a = args("mbconv", ins)
    expand = None if a.we is None else [a.x, a.we, a.be, a.se]
    first = a.x if expand is None else None
    return expand, [first, a.wd, a.bd, a.sd], [None, a.wp, a.bp, a.sp, a.residual]


def dw_rows_in(rows_out: int, attrs: dict, kh: int) -> int:
    """Input rows the depthwise conv reads for ``rows_out`` output rows."""
    sh, dh = attrs["strides"][0], attrs["dilations"][0]
    return (rows_out - 1) * sh + (kh - 1) * dh + 1


def intermediate_shapes(
    x_shape: Sequence[int], wd_shape: Sequence[int], y_shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the expanded tensor E (the depthwise conv's input) and of the depthwise
    conv's output D, channels-last. Depthwise weights are HWIO: ``[kh, kw, 1, C]``."""
    n, h, w, _ = x_shape
    ce = wd_shape[3]
    return (n, h, w, ce), (n, y_shape[1], y_shape[2], ce)


def composed(
    backend: str, slot: Callable[[Any, int, tuple[int, ...]], tuple[Any, int]]
) -> tuple[Callable, Callable]:
    """(bind, scratch) running the chain as ``backend``'s three conv kernels, with E and
    D whole in scratch (then each kernel's own scratch, reused by all three)."""
    from .registry import KERNELS

    def convs(a: Sequence, e, d, y, dtype: Callable) -> list:
        """(kernel, inputs, output, attrs key) per conv: ``a`` the node's inputs, and
        e, d, y the intermediates and the output, all as arrays or all as specs."""
        pe, pd, pp = parts(a)
        out = [] if pe is None else [("conv", pe, e, "expand")]
        out.append(("dwconv", [e if pd[0] is None else pd[0], *pd[1:]], d, "dw"))
        out.append(("conv", [d, *pp[1:]], y, "project"))
        return [(KERNELS[(op, dtype(i[1]), backend)], i, o, key) for op, i, o, key in out]

    def shapes(specs: Sequence, y_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        a = args("mbconv", specs)
        return intermediate_shapes(a.x[0], a.wd[0], y_shape)

    def has_expand(ins: Sequence) -> bool:
        return args("mbconv", ins).we is not None

    def scratch(specs, outs, attrs: dict) -> int:
        e, d = shapes(specs, outs[0])
        subs = convs(specs, (e, "f32"), (d, "f32"), (outs[0], "f32"), lambda s: s[1])
        own = max(k.scratch(i, [o[0]], attrs[key]) for k, i, o, key in subs)
        return (up64(nbytes(e)) if has_expand(specs) else 0) + up64(nbytes(d)) + up64(own)

    def bind(ins, outs, scr, attrs: dict):
        specs = [None if a is None else (tuple(a.shape), dtype_name(a.dtype)) for a in ins]
        e_shape, d_shape = shapes(specs, outs[0].shape)
        e, off = (None, 0) if not has_expand(ins) else slot(scr, 0, e_shape)
        d, off = slot(scr, up64(off), d_shape)
        rest = scr[up64(off) :]
        subs = convs(ins, e, d, outs[0], lambda a: dtype_name(a.dtype))
        steps = [k.bind(i, [o], rest, attrs[key]) for k, i, o, key in subs]

        def run() -> None:
            for s in steps:
                s()

        return run

    return bind, scratch
