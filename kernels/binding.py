"""Helpers every backend's bind functions share: a node's fused epilogue (activation
code and arguments, the flags of the optional inputs) and sizes. (A node's inputs by
role are kernels/ops.py's ``args``.)"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .activations import act_code
from .flags import HAS_BIAS, HAS_RES, HAS_SCALE


def act_args(attrs: dict) -> tuple[int, np.float32, np.float32]:
    """(activation code, a, b) of a node's fused activation."""
    a, b = attrs.get("act_args", (0.0, 0.0))
    return act_code(attrs.get("act", "none")), np.float32(a), np.float32(b)


def epilogue_flags(bias, scale, res) -> int:
    """Which optional epilogue inputs are present (the kernels' ``flags`` argument)."""
    return (
        (HAS_BIAS if bias is not None else 0)
        | (HAS_SCALE if scale is not None else 0)
        | (HAS_RES if res is not None else 0)
    )


def nbytes(shape: Sequence[int], itemsize: int = 4) -> int:
    return int(np.prod(shape)) * itemsize


def up64(n: int) -> int:
    """``n`` rounded up to a cache line: scratch buffers start on one (the arena is
    64-byte aligned)."""
    return -(-n // 64) * 64
