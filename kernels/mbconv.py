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

``qmbconv`` is the int8 chain (packager/mbconv.py ``fuse_mbconv``): a ``qconv``
expansion (float32 output), a ``qdwconv`` writing the projection's u8 codes and the
``qconv`` projection, each with the inputs it had (``ze``, ``zp``: the convs' ``zw``).

Here: splitting the inputs and the intermediate shapes (the cpu kernel and the
reference share them). Only the cpu backend asks for the pass that forms these nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from .ops import Y_QUANT, args


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


def qparts(ins: Sequence) -> tuple[list, list, list]:
    """``qmbconv``'s (expand, depthwise, projection) inputs in the roles of the
    ``qconv``, ``qdwconv`` and ``qconv`` they were (x, w, bias, scale[, residual, zw]),
    with ``None`` standing for the activation each takes from the one before."""
    a = args("qmbconv", ins)
    return (
        [a.x, a.we, a.be, a.se, None, a.ze],
        [None, a.wd, a.bd, a.sd],
        [None, a.wp, a.bp, a.sp, a.residual, a.zp],
    )


def q_project_attrs(attrs: dict) -> dict:
    """The projection's qconv attributes, with the chain's output codes (``y_scale``,
    ``y_zero``) when it writes them."""
    return attrs["project"] | {k: attrs[k] for k in Y_QUANT if k in attrs}
