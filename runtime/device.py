"""Where a bundle's arena lives and which backend each node binds to.

A ``Device`` is chosen once per Session (``select_device``) and handed to the
Executor, which then never asks which device it has: it allocates the arena through
the device, passes weights through it (the GPU uploads them once), copies inputs in
and outputs out through it. ``HostDevice`` is the NumPy arena the cpu and ref
backends use; ``CudaDevice`` (kernels/cuda/device.py, imported only when chosen) puts the
arena on the GPU.

Selection: a bundle whose nodes were planned for cuda runs on the GPU when one is
usable; ``device="cpu"`` binds its recorded host fallbacks instead. Without a usable
GPU the cuda nodes rebind to those fallbacks after one warning, or ``require_gpu``
turns that into a ``DeviceError``. A bundle planned for the host has no cuda kernels
recorded (its graph is laid out for the cpu kernels: channels-last regions, panels,
Winograd, fused chains), so ``device="cuda"`` refuses it: pack it for a cuda target.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .bundle_format import ALIGN

log = logging.getLogger("edgepack")

DEVICES = ("cpu", "cuda")
GPU_WEIGHTS = ("upload", "map")


class DeviceError(RuntimeError):
    """A GPU was required (``--require-gpu``) but none is usable."""


class Device(Protocol):
    kind: str  # "cpu" or "cuda": the backend family this device binds

    def describe(self) -> str: ...
    def arena(self, nbytes: int) -> Any: ...
    def weights(self, weights: Mapping[str, np.ndarray]) -> Mapping[str, Any]: ...
    def host_outputs(self, views: Sequence[Any]) -> list[np.ndarray]: ...
    def copy_in(self, dst: Any, src: np.ndarray) -> None: ...
    def fetch(self, hosts: Sequence[np.ndarray], views: Sequence[Any]) -> None: ...
    def to_host(self, view: Any) -> np.ndarray: ...
    def synchronize(self) -> None: ...


# Arenas of at least HUGE_ARENA_MIN bytes live in 2 MB pages, ARENA_SHIFT into the first
# one: their physical placement, which sets which tensors share cache sets, is then the
# same in every process. In 4 KB pages it was a draw at start: MobileNetV2 fp32 at 1
# thread took 7.5-8 ms in some processes and 10.5-13.5 in others. In 2 MB pages its
# time depends on where the arena starts: 11.3-12.0 ms 2 MB-aligned, 7.5-7.9 at shifts
# of 64 KB to 1.5 MB (2-core AMD EPYC, Zen 4; ResNet-18 the same either way).
HUGE_PAGE = 2 << 20
HUGE_ARENA_MIN = 1 << 20
ARENA_SHIFT = 192 << 10


def aligned_arena(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A zeroed uint8 buffer of ``nbytes`` whose first byte is ``align``-aligned (in 2 MB
    pages from HUGE_ARENA_MIN bytes, where the system offers them), every page of it
    already in memory (``_fault_in``)."""
    arena = _huge_page_arena(nbytes) if nbytes >= HUGE_ARENA_MIN else None
    if arena is None:
        raw = np.zeros(nbytes + align, np.uint8)
        start = (-raw.ctypes.data) % align
        arena = raw[start : start + nbytes]
    _fault_in(arena)
    return arena


def _fault_in(arena: np.ndarray) -> None:
    """Touch every page of a fresh arena, so the memory is taken at load and never in a
    run. Left to first use, the kernel zeroes a page when a run first writes it, and a
    2 MB page may first need compacting: an LLM serving its first sequence in a slot
    stalled 10-190 ms copying a shared prompt into that slot's cache (SmolLM2-135M,
    16 slots, 189 MB of cache; 2-core AMD EPYC). A fixed arena is also then resident
    from the start, as the plan's memory budget counts it, instead of growing. One byte
    a 4 KB page from the first, and the last byte: an arena that starts inside a page
    ends in a page the stride can step past."""
    arena[::4096] = 0
    arena[-1:] = 0


def _huge_page_arena(nbytes: int) -> np.ndarray | None:
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    size = nbytes + HUGE_PAGE + ARENA_SHIFT
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, np.uint8)  # holds the mapping for as long as a view lives
    start = (-raw.ctypes.data) % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, (size - start) // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # no transparent huge pages here: plain pages, same layout
        pass
    return raw[start + ARENA_SHIFT : start + ARENA_SHIFT + nbytes]  # anonymous: zeroed


class HostDevice:
    """The host: a NumPy arena; outputs are returned as the arena views themselves."""

    kind = "cpu"

    def describe(self) -> str:
        from ..kernels.cpu.native import K

        return "host CPU" if K.build == "jit" else f"host CPU, kernels built for {K.cpu}"

    def arena(self, nbytes: int) -> np.ndarray:
        a = aligned_arena(nbytes)
        if a.nbytes != nbytes or a.ctypes.data % ALIGN:
            raise RuntimeError("arena allocation does not match the plan")
        return a

    def weights(self, weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return weights  # the mmap'd views, zero-copy

    def host_outputs(self, views: Sequence[np.ndarray]) -> list[np.ndarray]:
        return list(views)

    def copy_in(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def fetch(self, hosts: Sequence[np.ndarray], views: Sequence[np.ndarray]) -> None:
        pass  # host_outputs are the views

    def to_host(self, view: np.ndarray) -> np.ndarray:
        return view.copy()

    def synchronize(self) -> None:
        pass


def planned_device(manifest: Mapping) -> str:
    """``"cuda"`` when the packager planned any node for the cuda backend."""
    nodes = manifest["graph"]["nodes"]
    return "cuda" if any(n["kernel"]["backend"] == "cuda" for n in nodes) else "cpu"


def select_device(
    manifest: Mapping,
    device: str | None = None,
    require_gpu: bool = False,
    gpu_weights: str = "upload",
) -> Device:
    """The device a bundle runs on (see the module doc); warns at most once per call."""
    if device not in (None, *DEVICES):
        raise ValueError(f"device {device!r}: choose from {', '.join(DEVICES)}")
    if gpu_weights not in GPU_WEIGHTS:
        raise ValueError(f"gpu weights {gpu_weights!r}: choose from {', '.join(GPU_WEIGHTS)}")
    if device == "cpu" and require_gpu:
        raise ValueError("--require-gpu contradicts --device cpu")
    planned = planned_device(manifest)
    want = device or ("cuda" if require_gpu else planned)
    if want == "cpu":
        return HostDevice()
    if planned != "cuda":
        why = "--require-gpu" if device is None else "--device cuda"
        raise DeviceError(
            f"{why}: this bundle was planned for the host only (its target's backends "
            "do not start with cuda), so it records no cuda kernels; build it for a "
            "cuda target (e.g. --target jetson-orin-nano) to run it on a GPU"
        )
    from ..kernels.cuda import device as cuda_dev  # numba.cuda/cupy themselves load only if usable

    ok, why = cuda_dev.probe()
    if ok:
        return cuda_dev.CudaDevice(gpu_weights)
    if require_gpu:
        raise DeviceError(f"a GPU is required (--require-gpu) but none is usable: {why}")
    log.warning(
        "edgepack: no usable GPU (%s); running the cuda-planned nodes on the cpu backend", why
    )
    return HostDevice()


def node_backend(node: Mapping, device: Device) -> str:
    """The backend a node binds to on ``device``: the one the bundle records for it, or on
    the host the fallback it records for a cuda node. Nothing is chosen here."""
    kinfo = node["kernel"]
    if device.kind == "cuda":
        if kinfo["backend"] != "cuda":
            raise DeviceError(
                f"node {node['name']!r} ({node['op']}) records no cuda kernel (planned "
                f"for {kinfo['backend']}): this bundle cannot run on the GPU"
            )
        return "cuda"
    if kinfo["backend"] != "cuda":
        return kinfo["backend"]
    fallback = kinfo.get("fallback")
    if not fallback:
        raise DeviceError(
            f"node {node['name']!r} ({node['op']}) was planned for cuda with no host kernel "
            "recorded (its target lists no host backend): this bundle needs its GPU"
        )
    return fallback["backend"]
