"""Run a planned graph: one arena, views at planned offsets, a pre-bound step list.

Everything that can be decided before the first inference is decided in ``__init__``
(views, kernel lookup, argument binding), so ``run`` is a loop over closures that
writes into memory that already exists. Where that memory lives (host or GPU) is the
``Device``'s business (runtime/device.py); the executor only goes through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..kernels.registry import lookup, node_dtype
from .bundle import BundleError
from .bundle_format import TENSOR_DTYPES
from .device import Device, aligned_arena, node_backend, select_device

Visit = Callable[[str, np.ndarray], None]  # a traced run's (tensor name, its value)
DTYPES = {k: np.dtype(v) for k, v in TENSOR_DTYPES.items()}  # arena tensors


def seeded_feeds(inputs, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Inputs for ``bench`` and for measuring quantization error without calibration
    data (``inputs``: the manifest's dicts of name, dtype and shape): normal noise for
    float inputs; zeros for integer ones (token ids and indices: 0 lies in every table)
    and True for bool masks."""
    rng = rng or np.random.default_rng(0)
    feeds = {}
    for i in inputs:
        dt = DTYPES[i["dtype"]]
        if dt.kind == "f":
            feeds[i["name"]] = rng.standard_normal(i["shape"]).astype(dt)
        else:
            feeds[i["name"]] = np.full(i["shape"], dt.kind == "b", dt)
    return feeds


__all__ = ["Executor", "RunError", "aligned_arena"]


class RunError(ValueError):
    """Bad inputs to ``run`` (wrong names, shapes or dtypes)."""


class Executor:
    """Binds a manifest (graph + plan) and its weights to one arena.

    Each node binds the kernel the bundle records for it (runtime/device.py's
    ``node_backend``; nothing is chosen again here). ``device`` is a ``Device``
    (shared, e.g. by the agent's workers) or a name for ``select_device`` (``None``: as
    planned). ``arena``: another executor's arena on the same device, for a graph
    planned with the same arena size and state (an LLM's prefill and decode graphs
    share their KV cache that way).
    """

    def __init__(
        self,
        manifest: Mapping,
        weights: Mapping[str, np.ndarray],
        device: Device | str | None = None,
        require_gpu: bool = False,
        gpu_weights: str = "upload",
        arena: Any = None,
    ) -> None:
        g, plan = manifest["graph"], manifest["plan"]
        self.graph = g
        self.inputs = g["inputs"]
        self.outputs = g["outputs"]
        if device is None or isinstance(device, str):
            device = select_device(manifest, device, require_gpu, gpu_weights)
        self.device: Device = device
        weights = device.weights(weights)
        arena_bytes = int(plan["arena_bytes"])
        if arena is not None and len(arena) != arena_bytes:  # another graph's, shared
            raise RuntimeError("the shared arena does not match this graph's plan")
        self.arena = device.arena(arena_bytes) if arena is None else arena
        self.views: dict[str, Any] = {}
        for name, off in plan["tensors"].items():
            t = g["tensors"][name]
            n = int(np.prod(t["shape"], dtype=np.int64)) * DTYPES[t["dtype"]].itemsize
            if off % 4 or off + n > arena_bytes:
                raise RuntimeError(f"tensor {name!r} planned outside the arena")
            self.views[name] = (
                self.arena[off : off + n].view(DTYPES[t["dtype"]]).reshape(t["shape"])
            )
        wspecs = manifest.get("weights", {})
        self.bound: list[tuple[dict, object]] = []  # (node, step or None) in graph order
        for node in g["nodes"]:
            ins = [self._resolve(n, weights) for n in node["inputs"]]
            outs = [self.views[n] for n in node["outputs"]]
            kinfo = node["kernel"]
            wdt = kinfo["dtype"]
            bname = node_backend(node, device)
            kern = lookup(node["op"], node_dtype(node["op"], wdt), bname)
            off, planned = plan["scratch"].get(node["name"], (0, 0))
            specs = [
                None if a is None else (tuple(a.shape), wspecs.get(n, {}).get("dtype", "f32"))
                for n, a in zip(node["inputs"], ins)
            ]
            out_shapes = [o.shape for o in outs]
            rec = _record(kinfo, bname)
            will = kern.variant(specs, out_shapes, node["attrs"])
            if will != rec.get("variant", ""):  # the CLI and serve report it as a bad bundle
                raise BundleError(
                    f"node {node['name']!r}: the bundle records variant "
                    f"{rec.get('variant', '')!r} of {kern.name}, this runtime would run "
                    f"{will!r} (bundle built by another edgepack version: rebuild it)"
                )
            need = kern.scratch(specs, out_shapes, node["attrs"])
            if need != rec["scratch"] or need > planned:
                raise BundleError(
                    f"node {node['name']!r}: kernel {kern.name} needs {need} B of scratch, "
                    f"the bundle records {rec['scratch']} B and reserved {planned} B (bundle "
                    "built by another edgepack version: rebuild it)"
                )
            step = kern.bind(ins, outs, self.arena[off : off + planned], node["attrs"])
            self.bound.append((node, step))
        self.steps = [s for _, s in self.bound if s is not None]
        self._in_views = [self.views[i["name"]] for i in self.inputs]
        self._in_specs = [(i["name"], DTYPES[i["dtype"]], tuple(i["shape"])) for i in self.inputs]
        self._out_views = [self.views[o["name"]] for o in self.outputs]
        self._out_host = device.host_outputs(self._out_views)

    def _resolve(self, name: str, weights: Mapping[str, Any]) -> Any:
        if not name:
            return None
        if name in weights:
            w = weights[name]
            # Read-only, as a bundle's mapped weights are, wherever these came from (a
            # build runs its graph on weights in memory): numba compiles a kernel per
            # argument type, read-only included, and the two kinds had compiled every
            # conv GEMM twice on a first run (~30 s each for the digits CNN).
            if isinstance(w, np.ndarray) and w.flags.writeable:
                w = w.view()
                w.flags.writeable = False
            return w
        return self.views[name]

    def _expected(self) -> str:
        return ", ".join(
            f"{i['name']} {i['dtype']}[{'x'.join(map(str, i['shape']))}]" for i in self.inputs
        )

    def check_inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The feeds in input order, or RunError naming what is wrong and what is expected.
        (The happy path builds no temporary objects: it runs on every inference.)"""
        if len(feeds) != len(self._in_specs) or any(n not in feeds for n, _, _ in self._in_specs):
            names = [n for n, _, _ in self._in_specs]
            unknown = sorted(set(feeds) - set(names))
            missing = [n for n in names if n not in feeds]
            parts = ([f"unknown: {', '.join(unknown)}"] if unknown else []) + (
                [f"missing: {', '.join(missing)}"] if missing else []
            )
            raise RunError(f"inputs {'; '.join(parts)}; expected: {self._expected()}")
        arrays = []
        for name, dtype, shape in self._in_specs:
            a = feeds[name]
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
            if a.dtype != dtype:
                raise RunError(
                    f"input {name!r} has dtype {a.dtype}, expected {dtype}; "
                    f"expected: {self._expected()}"
                )
            if a.shape != shape:
                raise RunError(
                    f"input {name!r} has shape {list(a.shape)}, expected "
                    f"{list(shape)}; expected: {self._expected()}"
                )
            arrays.append(a)
        return arrays

    def host_outputs(self) -> list[np.ndarray]:
        """The host arrays ``run_views`` fills and returns: the same objects every run."""
        return self._out_host

    def run_views(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run and return the outputs as host arrays owned by the executor (the arena
        views on the host) - valid until the next run."""
        dev = self.device
        for dst, src in zip(self._in_views, self.check_inputs(feeds)):
            dev.copy_in(dst, src)
        for step in self.steps:
            step()
        dev.fetch(self._out_host, self._out_views)
        return self._out_host

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; returns fresh copies of the outputs keyed by output name."""
        outs = self.run_views(feeds)
        return {o["name"]: v.copy() for o, v in zip(self.outputs, outs)}

    def run_traced(
        self, feeds: Mapping[str, np.ndarray], visit: Visit | None = None
    ) -> dict[str, np.ndarray]:
        """Run once and copy every node's output as it is produced (for error tables;
        the arena reuses memory, so intermediates must be captured step by step). With
        ``visit``, each output goes to it as it is produced instead, and nothing is kept."""
        dev = self.device
        for dst, src in zip(self._in_views, self.check_inputs(feeds)):
            dev.copy_in(dst, src)
        trace: dict[str, np.ndarray] = {}
        for node, step in self.bound:
            if step is not None:
                step()
            for o in node["outputs"]:
                value = _values(dev.to_host(self.views[o]), node["attrs"])
                if visit is None:
                    trace[o] = value
                else:
                    visit(o, value)
        return trace


def _values(a: np.ndarray, attrs: Mapping) -> np.ndarray:
    """A traced output as the values it stands for: an int8 op's u8 codes (its
    ``y_scale``, ``y_zero``) dequantized to float32, anything else as it is."""
    if a.dtype != np.uint8 or "y_scale" not in attrs:
        return a
    return (a.astype(np.float32) - np.float32(attrs["y_zero"])) * np.float32(attrs["y_scale"])


def _record(kinfo: Mapping, backend: str) -> Mapping:
    """The kernel record (the node's own or its fallback) for ``backend``;
    ``node_backend`` only returns a backend the node records."""
    return kinfo if kinfo["backend"] == backend else kinfo["fallback"]
