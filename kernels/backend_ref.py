"""The reference backend: every op, every dtype, straight from ``reference.py``.

It allocates on every call; it exists to be obviously right, not fast. (Channels-last
nodes are handled inside ``reference.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .reference import REFERENCE
from .registry import DTYPES, WEIGHT_OPS, Bound, Kernel, register


def _bind_ref(op: str):
    fn = REFERENCE[op]

    def bind(ins: Sequence[np.ndarray | None], outs: Sequence[np.ndarray], scratch, attrs) -> Bound:
        out = outs[0]
        args = list(ins)

        def step() -> None:
            out[...] = fn(args, attrs).reshape(out.shape)

        return step

    return bind


for _op in REFERENCE:
    register(
        _op,
        list(DTYPES) if _op in WEIGHT_OPS else ["f32"],
        "ref",
        Kernel(f"ref.{_op}", _bind_ref(_op)),
    )
