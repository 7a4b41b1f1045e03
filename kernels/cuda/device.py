"""The one place the cuda backend touches a GPU (or numba's CUDA simulator).

``dev()`` returns a process-wide ``Dev``: ``xp`` is the array module (cupy on a GPU,
NumPy under ``NUMBA_ENABLE_CUDASIM=1``), ``arg`` turns an ``xp`` array into what a
numba.cuda kernel takes (zero-copy both ways), ``launch`` picks the grid. The kernels
and every bind function are the same code in both modes; only this file branches.

``CudaDevice`` is the executor's view of it (runtime/device.py defines the interface):
it allocates the arena on the device, uploads the weights once (or maps them on
unified-memory boards), and moves inputs in and outputs out.

Nothing here is imported on the cpu path: numba.cuda and cupy load on first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SIM_ENV = "NUMBA_ENABLE_CUDASIM"
OFF_ENV = "EDGEPACK_NO_GPU"  # "1": behave as if no GPU were present (tests, A/B runs)
GPU_THREADS = 256
SIM_THREADS = 16  # the simulator runs a Python thread per CUDA thread: few, looping


def simulated() -> bool:
    """True when numba.cuda is (or will be) the simulator."""
    try:
        import numba
    except ImportError:  # a frozen cpu-only runtime: no numba at all
        return False
    # numba reads the variable when it is first imported; the env covers a later import.
    return bool(numba.config.ENABLE_CUDASIM) or os.environ.get(SIM_ENV, "0") == "1"


def probe() -> tuple[bool, str]:
    """(usable, what) for the cuda backend on this machine, without raising."""
    if os.environ.get(OFF_ENV, "0") == "1":
        return False, f"disabled by {OFF_ENV}=1"
    if simulated():
        return True, "numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
    try:
        import numba  # noqa: F401
    except ImportError:
        return False, "this runtime has no numba (a stub built for a target without cuda)"
    try:
        import cupy
    except ImportError as e:
        return False, f"cupy is not importable ({e}); install cupy-cuda12x or cupy-cuda11x"
    except Exception as e:  # a broken install raises what it raises; still a fallback
        return False, f"cupy failed to import ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises its own CUDARuntimeError when no driver is loaded
        return False, f"no CUDA driver or device ({e})"
    if n < 1:
        return False, "no CUDA device"
    try:
        from numba import cuda

        if not cuda.is_available():
            return False, "numba.cuda finds no usable GPU (driver missing or too old)"
        from numba.cuda.cudadrv import nvvm

        # Without libNVVM numba.cuda sees the GPU but cannot compile a kernel: better to
        # fall back now than to fail on the first run.
        if not nvvm.is_available():
            return False, (
                "numba.cuda cannot find libNVVM (set CUDA_HOME to a CUDA toolkit, e.g. "
                "JetPack's /usr/local/cuda, or pip install numba-cuda[cu12])"
            )
    except Exception as e:
        return False, f"numba.cuda cannot start ({e})"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return True, f"{name} (sm_{props['major']}{props['minor']})"


class Dev:
    """Array module, kernel-argument wrapping and launch shapes for one mode."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        self.simulated = simulated()
        if self.simulated:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            self.xp: Any = np
            # Wrapping (not copying) matters: the simulator would otherwise copy each
            # argument in and back out, and an in-place op's two views of one buffer
            # would overwrite each other on the way back.
            self._wrap = FakeCUDAArray
            self._threads = SIM_THREADS
        else:
            import cupy

            self.xp = cupy
            # sync=False: the arena is only touched on the default stream, in order.
            self._wrap = lambda a: cuda.as_cuda_array(a, sync=False)
            self._threads = GPU_THREADS

    def arg(self, a: Any) -> Any:
        """An ``xp`` array as a numba.cuda kernel argument (no copy)."""
        return self._wrap(a)

    def launch(self, kernel: Any, n: int) -> Any:
        """``kernel`` configured for ``n`` grid-stride items (bind once, call per run)."""
        t = self._threads
        blocks = 1 if self.simulated else max(1, min(-(-n // t), 65535))
        return kernel[blocks, t]

    def matmul(self, a: Any, b: Any, out: Any) -> None:
        """``out = a @ b``: cuBLAS through cupy on a GPU, NumPy under the simulator."""
        self.xp.matmul(a, b, out=out)

    def zeros(self, nbytes: int) -> Any:
        """A zeroed byte buffer on the device, 64-byte aligned like the host arena."""
        if self.simulated:
            raw = np.zeros(nbytes + 64, np.uint8)
            start = (-raw.ctypes.data) % 64
            return raw[start : start + nbytes]
        return self.xp.zeros(nbytes, self.xp.uint8)  # cupy allocations are 512-aligned

    def upload(self, a: np.ndarray) -> Any:
        """A device copy of a host array (weights: once, at load)."""
        if self.simulated:
            c = np.array(a, copy=True)
            c.setflags(write=False)
            return c
        return self.xp.asarray(np.ascontiguousarray(a))

    def copy_in(self, dst: Any, src: np.ndarray) -> None:
        if self.simulated:
            np.copyto(dst, src)
        else:
            dst.set(np.ascontiguousarray(src))

    def copy_out(self, dst: np.ndarray, src: Any) -> None:
        if self.simulated:
            np.copyto(dst, src)
        else:
            src.get(out=dst)  # blocking: waits for the kernels that wrote src

    def host_buffer(self, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        """Host memory for outputs: page-locked on a GPU so the copy is one DMA."""
        if self.simulated:
            return np.empty(shape, dtype)
        import cupyx

        return cupyx.empty_pinned(tuple(shape), dtype)

    def synchronize(self) -> None:
        if not self.simulated:
            self.xp.cuda.runtime.deviceSynchronize()

    def map_host(self, weights: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Device arrays over the host pages of ``weights`` (no copy).

        Meant for unified-memory boards (Jetson), where the GPU reads host memory at full
        speed: the bundle's mmap'd weights are page-locked once (cudaHostRegister, read
        only, mapped) and wrapped; the page cache then holds the only copy. On a discrete
        GPU this works too but every read crosses PCIe, so upload is the default.
        """
        if self.simulated or not weights:
            return dict(weights)
        cupy = self.xp
        rt = cupy.cuda.runtime
        arrays = list(weights.values())
        lo = min(a.ctypes.data for a in arrays)
        hi = max(a.ctypes.data + a.nbytes for a in arrays)
        page = os.sysconf("SC_PAGE_SIZE")
        base = lo - lo % page
        size = -(-(hi - base) // page) * page
        # Portable | Mapped | ReadOnly: the mmap is PROT_READ, and ReadOnly (CUDA 11.1+)
        # is what lets the driver pin it.
        rt.hostRegister(base, size, 0x1 | 0x2 | 0x8)
        dbase = rt.hostGetDevicePointer(base, 0)
        holder = _Registered(base, arrays)
        mem = cupy.cuda.UnownedMemory(dbase, size, holder)
        out = {}
        for name, a in weights.items():
            ptr = cupy.cuda.MemoryPointer(mem, a.ctypes.data - base)
            out[name] = cupy.ndarray(a.shape, a.dtype, ptr)
        return out


class _Registered:
    """Keeps the host arrays alive while device views of them exist; unregisters after."""

    def __init__(self, base: int, arrays: list[np.ndarray]) -> None:
        self.base, self.arrays = base, arrays

    def __del__(self) -> None:
        try:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.base)
        except Exception:  # interpreter shutdown: the driver unpins with the process
            pass


_DEV: Dev | None = None


def dev() -> Dev:
    global _DEV
    if _DEV is None:
        _DEV = Dev()
    return _DEV


class CudaDevice:
    """The executor's device for the cuda backend: arena and weights on the GPU."""

    kind = "cuda"

    def __init__(self, weights_mode: str = "upload") -> None:
        if weights_mode not in ("upload", "map"):
            raise ValueError(f"gpu weights {weights_mode!r}: use upload or map")
        self.dev = dev()
        self.weights_mode = weights_mode
        # id(host mapping) -> (host mapping, device mapping); the host mapping is kept so
        # its id cannot be reused by another while the entry exists.
        self._weights: dict[int, tuple[Mapping[str, np.ndarray], Mapping[str, Any]]] = {}

    def describe(self) -> str:
        return probe()[1]

    def arena(self, nbytes: int) -> Any:
        return self.dev.zeros(nbytes)

    def weights(self, weights: Mapping[str, np.ndarray]) -> Mapping[str, Any]:
        # Once per weight set and device: executors of one session (the agent's workers)
        # share the uploaded copy instead of each holding its own.
        key = id(weights)
        if key not in self._weights:
            if self.weights_mode == "map":
                up = self.dev.map_host(weights)
            else:
                up = {k: self.dev.upload(v) for k, v in weights.items()}
            self._weights[key] = (weights, up)
        return self._weights[key][1]

    def host_outputs(self, views: Sequence[Any]) -> list[np.ndarray]:
        return [self.dev.host_buffer(v.shape, v.dtype) for v in views]

    def copy_in(self, dst: Any, src: np.ndarray) -> None:
        self.dev.copy_in(dst, src)

    def fetch(self, hosts: Sequence[np.ndarray], views: Sequence[Any]) -> None:
        for h, v in zip(hosts, views):
            self.dev.copy_out(h, v)

    def to_host(self, view: Any) -> np.ndarray:
        out = np.empty(view.shape, view.dtype)
        self.dev.copy_out(out, view)
        return out

    def synchronize(self) -> None:
        self.dev.synchronize()
