"""Kernels for weights stored canonical (int4, kernels/wtypes.py): decode, then float32.

int4 weights are stored ``[N, Kp/2]`` with group scales whatever layout the node runs
in; the node attribute ``wshape`` is their logical (OIHW, or linear's ``[N, K]``)
shape. ``decoded`` turns a backend's float32 kernel for an op into one for such
weights: each run first decodes them into float32 scratch in the layout the node
computes in (``layout.node_weight_shape``: OIHW, HWIO or panels; one decoder kernel
per backend, told where each weight goes by ``layout.weight_offsets``), then runs
the float32 kernel on that scratch with the scale input consumed. The scratch is the
decoded weights followed by the float32 kernel's own.

This is how every backend runs int4 convs and batched linears; batch-1 linears on
the CPU skip the float32 copy (backend_cpu's fused int4 GEMV).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .binding import nbytes, up64
from .layout import node_weight_shape, weight_offsets
from .ops import args, role
from .registry import Kernel

# (packed weights, group scales, float32 destination (flat), rows, cols) -> step
DecodeFn = Callable[[Any, Any, Any, np.ndarray, np.ndarray], Callable[[], None]]
SlotFn = Callable[[Any, int, tuple[int, ...]], tuple[Any, int]]


def _inner_specs(op: str, specs: Sequence, attrs: dict) -> list:
    """The float32 kernel's input specs: the weight decoded, in the node's layout."""
    a = list(args(op, specs))
    a[role(op, "w")] = (node_weight_shape(op, attrs["wshape"], attrs), "f32")
    a[role(op, "scale")] = None  # the group scales: consumed by the decoder
    return a[: len(specs)]


def decoded_scratch(op: str, attrs: dict) -> int:
    """Bytes of the decoded weights at the front of the scratch."""
    return up64(nbytes(node_weight_shape(op, attrs["wshape"], attrs)))


def decoded(op: str, f32_kernel: Kernel, decode: DecodeFn, slot: SlotFn, name: str) -> Kernel:
    """``f32_kernel`` (op ``op``) extended to canonical int4 weights (module doc)."""

    def scratch(ins, outs, attrs: dict) -> int:
        return decoded_scratch(op, attrs) + f32_kernel.scratch(
            _inner_specs(op, ins, attrs), outs, attrs
        )

    def bind(ins, outs, scr, attrs: dict):
        shape = node_weight_shape(op, attrs["wshape"], attrs)
        wf, _ = slot(scr, 0, shape)
        rows, cols = weight_offsets(op, attrs["wshape"], attrs)
        io = args(op, ins)
        step_decode = decode(io.w, io.scale, wf.reshape(-1), rows, cols)
        a = list(io)
        a[role(op, "w")], a[role(op, "scale")] = wf, None
        inner = f32_kernel.bind(a[: len(ins)], outs, scr[decoded_scratch(op, attrs) :], attrs)

        def step() -> None:
            step_decode()
            if inner is not None:
                inner()

        return step

    def variant(ins, outs, attrs: dict) -> str:
        inner = f32_kernel.variant(_inner_specs(op, ins, attrs), outs, attrs)
        return "decode_q4+" + (inner or "f32")

    return Kernel(name, bind, scratch, f32_kernel.accepts, variant)
