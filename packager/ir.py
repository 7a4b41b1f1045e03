"""edgepack's graph IR: a topologically ordered list of lowered ops.

Activations are float32 tensors with static shapes; constants (weights) are NumPy
arrays. The op set and each op's input order are documented in
docs/bundle-format.md; they are the same ops the kernels dispatch on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kernels import ops
from ..kernels.wtypes import of_array


def of_array_or_none(a: np.ndarray) -> str | None:
    try:
        return of_array(a)
    except ValueError:
        return None


class PackError(Exception):
    """The model cannot be packed (unsupported op, attribute or dtype...)."""


@dataclass
class Node:
    op: str
    name: str
    inputs: list[str]  # "" marks an absent optional input
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # ONNX nodes folded into this one

    def input(self, role: str) -> str:
        """The tensor in input role ``role`` (kernels/ops.py), "" when absent."""
        i = ops.role(self.op, role)
        return self.inputs[i] if i < len(self.inputs) else ""

    def set_input(self, role: str, name: str) -> None:
        """Put ``name`` in input role ``role``, padding absent ones before it with ""."""
        i = ops.role(self.op, role)
        self.inputs += [""] * (i + 1 - len(self.inputs))
        self.inputs[i] = name


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    shapes: dict[str, tuple[int, ...]]  # activation tensors
    consts: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)
    # Weight type (kernels/wtypes.py) of constants whose numpy dtype does not say it:
    # int4's packed uint8, bfloat16's uint16 bit patterns.
    wtypes: dict[str, str] = field(default_factory=dict)
    # Arena tensors that are not float32 (runtime/bundle_format.py TENSOR_DTYPES): an
    # LLM's int32 token ids and positions, its fp16 KV caches.
    dtypes: dict[str, str] = field(default_factory=dict)
    # Tensors that persist from one run to the next (an LLM's KV caches): the plan puts
    # them first in the arena, at the same offsets in every graph of a bundle, and
    # never lends their bytes to anything else.
    state: list[str] = field(default_factory=list)

    def dtype(self, tensor: str) -> str:
        """The dtype name of arena tensor ``tensor`` (``f32`` unless recorded)."""
        return self.dtypes.get(tensor, "f32")

    def wtype(self, name: str) -> str:
        """The stored type of constant ``name`` (a row of kernels/wtypes.py, or a plain
        tensor's short dtype name)."""
        return self.wtypes.get(name) or of_array(self.consts[name])

    def set_const(self, name: str, value: np.ndarray, wtype: str | None = None) -> None:
        """Add or replace a constant, with its weight type when the dtype does not say it."""
        self.consts[name] = value
        if wtype is None or wtype == of_array_or_none(value):
            self.wtypes.pop(name, None)
        else:
            self.wtypes[name] = wtype

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def producer(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def is_const(self, name: str) -> bool:
        return name in self.consts

    def remove_dead(self) -> None:
        """Drop nodes and constants nothing reachable from the outputs reads."""
        live = set(self.outputs)
        kept = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(i for i in n.inputs if i)
        self.nodes = kept[::-1]
        self.consts = {k: v for k, v in self.consts.items() if k in live}
        self.wtypes = {k: v for k, v in self.wtypes.items() if k in live}
        keep = {*self.inputs, *self.state}
        self.shapes = {k: v for k, v in self.shapes.items() if k in live or k in keep}
        self.dtypes = {k: v for k, v in self.dtypes.items() if k in self.shapes}
