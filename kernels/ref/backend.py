"""The reference backend: every op, every dtype, straight from ``reference.py``.

It allocates on every call; it exists to be obviously right, not fast. (Channels-last
nodes are handled inside ``reference.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..registry import WEIGHT_OPS, Bound, Kernel, register
from ..wtypes import ROWS
from .reference import REFERENCE, node_weights


def _bind_ref(op: str, dt: str):
    fn = REFERENCE[op]

    def bind(ins: Sequence[np.ndarray | None], outs: Sequence[np.ndarray], scratch, attrs) -> Bound:
        out = outs[0]
        args = list(ins)

        def step() -> None:
            feed = node_weights(dt, args, op, attrs) if dt != "f32" else args
            out[...] = fn(feed, attrs).reshape(out.shape)

        return step

    return bind


for _op in REFERENCE:
    for _row in ROWS:
        if _row.name == "f32" or (_op in WEIGHT_OPS and _op in _row.ops):
            register(_op, [_row.name], "ref", Kernel(f"ref.{_op}", _bind_ref(_op, _row.name)))
