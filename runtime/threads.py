"""Thread count for numba kernels and the BLAS behind NumPy's matmul."""

from __future__ import annotations

_limiter = None


def set_threads(n: int | None) -> int:
    """Use ``n`` threads (None: leave the defaults). Returns the count in force."""
    import numba

    global _limiter
    if n is None:
        return numba.get_num_threads()
    if n < 1:
        raise ValueError("--threads must be >= 1")
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: without it BLAS keeps its own default
        return n
    _limiter = threadpool_limits(limits=n, user_api="blas")
    return n
