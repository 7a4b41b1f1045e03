"""IR + plan -> the manifest dict the runtime executes (also used in memory at pack
time, so the error table is measured with the very kernels the device will run)."""

from __future__ import annotations

import numpy as np

from ..runtime.bundle_format import FORMAT_VERSION
from .ir import Graph
from .plan import Plan


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _io(g: Graph, t: str) -> dict:
    return {"name": t, "shape": list(g.shapes[t]), "dtype": g.dtype(t)}


def make_manifest(g: Graph, plan: Plan, extra: dict | None = None) -> dict:
    tensors = {t: {"shape": list(s), "dtype": g.dtype(t)} for t, s in g.shapes.items()}
    nodes = [
        {
            "name": n.name,
            "op": n.op,
            "inputs": list(n.inputs),
            "outputs": list(n.outputs),
            "attrs": _jsonable(n.attrs),
            "kernel": plan.kernels[n.name],
            "sources": list(n.sources),
        }
        for n in g.nodes
    ]
    m = {
        "format": "edgepack-bundle",
        "format_version": FORMAT_VERSION,
        "graph": {
            "inputs": [_io(g, t) for t in g.inputs],
            "outputs": [_io(g, t) for t in g.outputs],
            "tensors": tensors,
            "nodes": nodes,
            **({"state": list(g.state)} if g.state else {}),
        },
        "weights": {k: {"shape": list(v.shape), "dtype": g.wtype(k)} for k, v in g.consts.items()},
        "plan": {
            "arena_bytes": plan.arena_bytes,
            "alignment": 64,
            "tensors": plan.tensors,
            "scratch": {k: list(v) for k, v in plan.scratch.items()},
        },
    }
    m.update(_jsonable(extra or {}))
    return m
