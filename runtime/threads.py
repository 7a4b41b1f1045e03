"""Thread count for the kernels and for the BLAS behind NumPy's matmul.

The JIT kernels run their parallel loops on numba's thread pool; the AOT kernels
shipped in device executables on edgepack's kernel pool (kernels/cpu/pool.py: numba's
ahead-of-time compiler has no parallel loops), which starts with one thread per core
this process may use, as numba does, at most the target's ``default_threads``.
"""

from __future__ import annotations

_limiter = None


def set_threads(n: int | None) -> int | None:
    """Use ``n`` threads (None: leave the defaults). Returns the count in force, if known."""
    from ..kernels.cpu.native import K

    global _limiter
    if K.build != "jit":
        from ..kernels.cpu.pool import POOL, default_threads

        if n is None:
            return POOL[0].threads
        if n >= 1:  # capped as numba caps the JIT's: at the cores this process may use
            n = min(n, default_threads())
            POOL[0].resize(n)
    else:
        import numba

        if n is None:
            return numba.get_num_threads()
        n = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(n)
        from ..kernels.cpu.native import note_threads

        note_threads(n)
    if n is None:
        return None
    if n < 1:
        raise ValueError("--threads must be >= 1")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: without it BLAS keeps its own default
        return n
    _limiter = threadpool_limits(limits=blas_threads(n), user_api="blas")
    return n


def blas_threads(n: int) -> int:
    """BLAS's threads beside ``n`` kernel threads: ``n``, except where numpy was imported
    before edgepack with OpenBLAS's default wait (edgepack.BLAS_SPINS_SHORT false). Its
    workers then spin 0.1 s after every call, which at a few ms a run is always, and
    held a core the kernels' threads needed. On the calling thread alone BLAS wakes no
    worker: MobileNetV2 fp32 (a BLAS classifier) at 2 threads, numpy imported first,
    medians of 100-run blocks 7.0-16.0 ms (P99 21-25) -> 4.8-5.5 (P99 5.7-9.4), against
    8.6 at one thread (AOT kernels, alternating processes)."""
    from .. import BLAS_SPINS_SHORT

    return n if BLAS_SPINS_SHORT else 1
