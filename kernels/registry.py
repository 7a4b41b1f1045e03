"""The one dispatch table: ``(op, dtype, backend) -> Kernel`` (ggml's type-traits idea).

``dtype`` is the weight type of the op's weight (a row of wtypes.py: ``f32``, ``f16``,
``bf16``, ``i8``, ``i4``) for ops that carry one, else ``f32``. A kernel is bound once,
when the runtime loads a bundle, to fixed arena views; binding returns a zero-argument
closure (or None when the op is a no-op, e.g. a reshape aliased in the memory plan).
The steady-state loop is then just ``for step in steps: step()``.

The packager asks the same table how much scratch each kernel needs so the memory
plan reserves it in the arena ahead of time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import ops
from .wtypes import ROWS

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name)
Bound = Callable[[], None] | None
BindFn = Callable[[Sequence["np.ndarray | None"], Sequence[np.ndarray], np.ndarray, dict], Bound]
ScratchFn = Callable[[Sequence["Spec | None"], Sequence[tuple[int, ...]], dict], int]

# dtype key -> numpy storage dtype: the rows of the weight-type table.
DTYPES: dict[str, np.dtype] = {r.name: r.storage for r in ROWS}
WEIGHT_OPS = ops.WEIGHT_OPS  # ops whose kernels are keyed by their weight's type
@dataclass(frozen=True)
class Backend:
    """What the packager needs to know about a backend before binding anything."""

    module: str  # registers its kernels on import (relative to this package)
    host: bool  # computes in host memory (a fallback for a device backend's nodes)
    # Graph passes the packager runs when this backend is a target's first choice
    # (each pass's module says why, with its measurement): Winograd convs, channels-
    # last regions, GEMM weight panels, banded pointwise-depthwise-pointwise chains,
    # int8 activations for int8 convs (packager/act_quant.py), int4 and int8 weights
    # interleaved by rows for the int8-activation linears (packager/layout.py interleave_rows).
    passes: tuple[str, ...] = ()


# One row per backend, in host fallback order (cpu before ref): a table, so the
# registry imports no backend and no backend knows another.
BACKEND_TABLE: dict[str, Backend] = {
    "cpu": Backend(
        ".cpu.backend",
        True,
        ("winograd", "channels_last", "panels", "chains", "act_quant", "interleave"),
    ),
    "ref": Backend(".ref.backend", True),
    "cuda": Backend(".cuda.backend", False),
}
BACKENDS = tuple(BACKEND_TABLE)
HOST_BACKENDS = tuple(b for b, row in BACKEND_TABLE.items() if row.host)
PASSES = ("winograd", "channels_last", "panels", "chains", "act_quant", "interleave")
# The ops a pass creates: only a backend that asks for the pass meets them, so only such
# a backend needs kernels for them (the cuda backend has no conv_wino or mbconv).
PASS_OPS = {
    "winograd": ("conv_wino",),
    "chains": ("mbconv", "qmbconv"),
    "act_quant": ("qconv", "qdwconv"),
}
assert all(set(row.passes) <= set(PASSES) for row in BACKEND_TABLE.values())
assert set(PASS_OPS) <= set(PASSES)


def wants(backends: Sequence[str], graph_pass: str) -> bool:
    """Whether the packager runs ``graph_pass`` for a target preferring ``backends``."""
    assert graph_pass in PASSES, graph_pass
    return bool(backends) and graph_pass in BACKEND_TABLE[backends[0]].passes


def _no_scratch(ins: Sequence[Spec | None], outs: Sequence[tuple[int, ...]], attrs: dict) -> int:
    return 0


def _one_variant(ins: Sequence[Spec | None], outs: Sequence[tuple[int, ...]], attrs: dict) -> str:
    return ""


@dataclass(frozen=True)
class Kernel:
    name: str
    bind: BindFn
    scratch: ScratchFn = _no_scratch
    # Attribute values this kernel handles (e.g. only constant-mode Pad); the
    # packager falls back to the next backend when it says no.
    accepts: Callable[[dict], bool] = lambda attrs: True
    # Which of its code paths the kernel takes for a node (same arguments as scratch;
    # "" for a kernel with one). The packager records it in the bundle and the bind
    # takes the path by this same function, so the runtime can refuse a bundle whose
    # recorded variant it would not run.
    variant: ScratchFn = _one_variant


KERNELS: dict[tuple[str, str, str], Kernel] = {}


def register(op: str, dtypes: Sequence[str], backend: str, kernel: Kernel) -> None:
    for dt in dtypes:
        key = (op, dt, backend)
        if key in KERNELS:
            raise RuntimeError(f"kernel {key} registered twice")
        KERNELS[key] = kernel


def node_dtype(op: str, weight_dtype: str | None) -> str:
    return weight_dtype if op in WEIGHT_OPS and weight_dtype else "f32"


def lookup(op: str, dtype: str, backend: str) -> Kernel:
    _load_backends()
    try:
        return KERNELS[(op, dtype, backend)]
    except KeyError:
        have = sorted(f"{o}/{d}" for (o, d, b) in KERNELS if b == backend)
        raise KeyError(
            f"no kernel for op {op!r} with dtype {dtype!r} on backend {backend!r}; "
            f"this backend has: {', '.join(have)}"
        ) from None


def choose(op: str, dtype: str, attrs: dict, backends: Sequence[str]) -> tuple[str, Kernel]:
    """First backend in preference order whose kernel takes this node (packager side)."""
    _load_backends()
    for b in backends:
        k = KERNELS.get((op, dtype, b))
        if k is not None and k.accepts(attrs):
            return b, k
    raise KeyError(
        f"no kernel for op {op!r} ({dtype}) with these attributes on backends {', '.join(backends)}"
    )


_loaded = False


def _load_backends() -> None:
    # Backends register themselves on import; done lazily so importing the table
    # does not compile numba kernels. backend_cuda only registers: numba.cuda and cupy
    # load when one of its kernels is bound.
    global _loaded
    if not _loaded:
        _loaded = True
        for row in BACKEND_TABLE.values():
            importlib.import_module(row.module, __package__)
