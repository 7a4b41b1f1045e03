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
    _limiter = threadpool_limits(limits=n, user_api="blas")
    return n
