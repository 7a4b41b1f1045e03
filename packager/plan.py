"""Memory plan: every activation and every kernel's scratch gets a fixed arena offset.

Lifetimes come from the op order; storages that are never alive at the same time
may share bytes. Placement is greedy by size (largest first, lowest offset that fits
against everything alive at the same time), as TFLite's arena planner does.
Reshape outputs alias their input (same bytes, no copy), and so do slices that are
one contiguous block of it, at that block's offset (an LSTM's last step, a channel
split at batch 1); elementwise ops write in place when their input dies there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..kernels.ops import slice_block
from ..kernels.registry import BACKEND_TABLE, WEIGHT_OPS, choose, node_dtype
from ..runtime.bundle_format import ALIGN, TENSOR_DTYPES, align_up
from .ir import Graph, PackError

INPLACE_OPS = ("unary", "binary", "channel_affine")
# Ops whose output may be a view of input 0: element offset of the view, or None.
ALIAS_OPS = {
    "reshape": lambda shape, attrs: 0,
    "slice": slice_block,
}


@dataclass
class Plan:
    arena_bytes: int
    tensors: dict[str, int]  # activation -> offset
    scratch: dict[str, tuple[int, int]]  # node -> (offset, bytes)
    kernels: dict[str, dict]  # node -> {"backend", "dtype", "name", "scratch", ...}
    naive_bytes: int = 0  # what one buffer per tensor would cost (for the report)
    storages: list = field(default_factory=list)


def _specs(g: Graph, node) -> tuple[list, list]:
    """(input specs, output shapes) of a node as the kernels' scratch and variant rules
    take them: (shape, type) per input, None where absent."""
    specs = [
        None
        if not t
        else ((tuple(g.consts[t].shape), g.wtype(t)) if t in g.consts else (g.shapes[t], "f32"))
        for t in node.inputs
    ]
    return specs, [g.shapes[o] for o in node.outputs]


def _record(node, backend: str, k, specs: list, outs: list) -> dict:
    """What the bundle records of one kernel for a node: its backend and name, the
    variant it runs ("" omitted) and the scratch bytes it takes (the runtime binds
    exactly this, or refuses)."""
    rec = {"backend": backend, "name": k.name, "scratch": int(k.scratch(specs, outs, node.attrs))}
    variant = k.variant(specs, outs, node.attrs)
    if variant:
        rec["variant"] = variant
    return rec


def choose_kernels(g: Graph, backends: Sequence[str]) -> dict[str, dict]:
    """Per node: the first backend in ``backends`` that takes it, with the variant and
    scratch its kernel has for this node. When the first backend is a device (cuda),
    every node must be its: a graph does not hop between GPU and host memory, so a node
    it declines fails the build here. Each such node also records ``fallback``, the host
    kernel the runtime binds instead when the device has no usable GPU; the plan
    reserves the larger of the two scratches. No kernel is asked to fit another's."""
    host = [b for b in backends if BACKEND_TABLE[b].host]
    device_first = bool(backends) and not BACKEND_TABLE[backends[0]].host
    out = {}
    for node in g.nodes:
        specs, outs = _specs(g, node)
        wdt = g.wtype(node.input("w")) if node.op in WEIGHT_OPS else "f32"
        dt = node_dtype(node.op, wdt)
        try:
            backend, k = choose(node.op, dt, node.attrs, backends)
        except KeyError as e:
            raise PackError(
                f"node {node.name!r} (from ONNX {', '.join(node.sources)}): "
                f"{e.args[0]}; the target cannot run it"
            ) from None
        if device_first and backend != backends[0]:
            raise PackError(
                f"node {node.name!r} (from ONNX {', '.join(node.sources)}): op {node.op!r} "
                f"({wdt}) has no {backends[0]} kernel for its attributes, and a "
                f"{backends[0]}-planned graph runs every node on the device"
            )
        out[node.name] = {"dtype": wdt, **_record(node, backend, k, specs, outs)}
        if device_first and host:
            try:
                fb, fk = choose(node.op, dt, node.attrs, host)
            except KeyError:
                continue  # no host kernel: the bundle then needs its GPU
            out[node.name]["fallback"] = _record(node, fb, fk, specs, outs)
    return out


def _scratch_needs(kernels: dict[str, dict]) -> dict[str, int]:
    """Per node, the larger scratch of its kernel and its fallback: either may bind to
    these bytes."""
    out = {}
    for name, kinfo in kernels.items():
        need = max(kinfo["scratch"], kinfo.get("fallback", {}).get("scratch", 0))
        if need:
            out[name] = need
    return out


def tensor_bytes(g: Graph, t: str) -> int:
    """Bytes arena tensor ``t`` of ``g`` takes (its shape times its dtype's size)."""
    return int(np.prod(g.shapes[t], dtype=np.int64)) * np.dtype(TENSOR_DTYPES[g.dtype(t)]).itemsize


def plan_memory(g: Graph, backends: Sequence[str] = ("cpu", "ref")) -> Plan:
    kernels = choose_kernels(g, backends)
    nbytes = {t: tensor_bytes(g, t) for t in g.shapes}
    end = len(g.nodes)
    born = {t: -1 for t in g.inputs}
    used = {t: -1 for t in g.shapes}
    for i, node in enumerate(g.nodes):
        for t in node.outputs:
            born[t] = i
        for t in node.inputs:
            if t in g.shapes:
                used[t] = i
    for t in (*g.outputs, *g.state):
        used[t] = end
    for t in g.state:
        born[t] = -1

    # Storages as a union-find over tensors, each at a byte offset into its parent's:
    # alias outputs (reshape, contiguous slices) always join their input; an
    # elementwise output joins its input when that storage is not read later.
    parent = {t: t for t in g.shapes}
    delta = dict.fromkeys(g.shapes, 0)  # bytes from the parent's start

    def find(t: str) -> tuple[str, int]:
        """(root storage, byte offset of t in it), compressing the path."""
        path = []
        while parent[t] != t:
            path.append(t)
            t = parent[t]
        total = 0
        for p in reversed(path):  # nearest the root first
            total += delta[p]
            parent[p], delta[p] = t, total
        return t, (delta[path[0]] if path else 0)

    def root(t: str) -> str:
        return find(t)[0]

    def join(child: str, into: str, off: int = 0) -> None:
        """child's bytes are into's, from byte ``off`` of it."""
        (rc, dc), (ri, di) = find(child), find(into)
        at = di + off - dc  # where rc's storage starts inside ri's
        if at < 0 or at + nbytes[rc] > nbytes[ri]:
            raise PackError(f"plan: {child!r} does not fit inside {into!r} at {off}")
        parent[rc], delta[rc] = ri, at
        last[ri] = max(last[ri], last[rc])
        born_at[ri] = min(born_at[ri], born_at[rc])

    last = {t: used[t] for t in g.shapes}
    born_at = dict(born)
    state = set(g.state)
    for node in g.nodes:
        src = node.inputs[0] if node.inputs and node.inputs[0] in g.shapes else None
        view = ALIAS_OPS.get(node.op)
        if view is None or src is None:
            continue
        if node.op != "reshape" and root(src) in state:  # ops write state: copy a part
            continue
        out = node.outputs[0]
        at = view(g.shapes[src], node.attrs)
        if at is not None and g.dtype(src) == g.dtype(out):
            join(out, src, at * np.dtype(TENSOR_DTYPES[g.dtype(src)]).itemsize)
    for i, node in enumerate(g.nodes):
        src = node.inputs[0] if node.inputs and node.inputs[0] in g.shapes else None
        out = node.outputs[0]
        if (
            node.op in INPLACE_OPS
            and src is not None
            and last[root(src)] == i
            and nbytes[src] == nbytes[out]
            and root(src) != root(out)
        ):
            join(out, src)

    scratch_req = _scratch_needs(kernels)
    node_index = {n.name: i for i, n in enumerate(g.nodes)}
    roots = sorted({root(t) for t in g.shapes})
    items = [(nbytes[r], born_at[r], last[r], ("t", r)) for r in roots if r not in state]
    items += [(need, node_index[n], node_index[n], ("s", n)) for n, need in scratch_req.items()]

    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    offset_of: dict[tuple, int] = {}
    # State first, in its listed order, from offset 0: every graph of a bundle with the
    # same state finds it at the same offsets, whatever else it plans around it.
    top = 0
    for t in g.state:
        if root(t) != t:
            raise PackError(f"state tensor {t!r} shares storage with another tensor")
        placed.append((top, nbytes[t], -1, end))
        offset_of[("t", t)] = top
        top += align_up(max(nbytes[t], 1))
    for sz, f, l_, key in sorted(items, key=lambda it: (-it[0], it[1], str(it[3]))):
        asz = align_up(max(sz, 1))
        conflicts = sorted(
            (o, o + align_up(s)) for o, s, pf, pl in placed if not (pl < f or l_ < pf)
        )
        off = 0
        for lo, hi in conflicts:
            if off + asz <= lo:
                break
            off = max(off, hi)
        placed.append((off, sz, f, l_))
        offset_of[key] = off
    arena = align_up(max((o + s for o, s, _, _ in placed), default=0), ALIGN)
    return Plan(
        arena_bytes=arena,
        tensors={t: offset_of[("t", root(t))] + find(t)[1] for t in g.shapes},
        scratch={n: (offset_of[("s", n)], need) for n, need in scratch_req.items()},
        kernels=kernels,
        naive_bytes=sum(nbytes.values()) + sum(scratch_req.values()),
        storages=[(nbytes[r], born_at[r], last[r]) for r in roots],
    )
