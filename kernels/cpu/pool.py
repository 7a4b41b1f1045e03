"""The ahead-of-time kernels' thread pool, as Python sees it: its state and its size.

The pool itself is machine code in the AOT extension (native_pool.py): a kernel with
parallel loops is exported as a launcher taking this state first, and helper threads
started by the extension's ``pool_start`` run its parts. Python only owns the state
array (which must outlive the helpers: they hold its address) and sets how many parts
a kernel call uses.
"""

from __future__ import annotations

import os

import numpy as np

from .abi import POOL_PARK, POOL_SPIN, POOL_STARTED, POOL_STATE_LEN, POOL_WANT


def default_threads() -> int:
    """The cores this process may run on (its affinity mask, as numba's default)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def spin_polls() -> int:
    """Polls a helper makes before it sleeps: ``EDGEPACK_POOL_SPIN``, else 0 (the
    compiled default, native_pool.SPIN)."""
    raw = os.environ.get("EDGEPACK_POOL_SPIN", "0")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"EDGEPACK_POOL_SPIN={raw!r}: a whole number of polls") from None
    if n < 0:
        raise ValueError(f"EDGEPACK_POOL_SPIN={raw!r}: 0 or more polls")
    return n


class KernelPool:
    """``start(state, n)`` starts helper threads until n run (native_pool.pool_start)."""

    def __init__(self, start, threads: int = 1):
        self.state = np.zeros(POOL_STATE_LEN, np.int64)
        _KEPT.append(self.state)  # the helpers poll it by address for the process's life
        self._start = start
        self.state[POOL_SPIN] = spin_polls()
        self.resize(threads)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    @property
    def threads(self) -> int:
        """Parts a kernel call runs in now (caller included)."""
        return int(max(1, min(self.state[POOL_WANT], self.state[POOL_STARTED])))

    def resize(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.state[POOL_WANT] = threads
        self._start(self.state, threads)

    def _after_fork(self) -> None:
        # a forked child has only the thread that forked: clear the job, the tickets
        # and the count, so its first parallel call starts helpers of its own
        want = int(self.state[POOL_WANT])
        self.state[:] = 0
        self.state[POOL_SPIN] = spin_polls()
        self.resize(max(1, want))


_KEPT: list[np.ndarray] = []
POOL: list[KernelPool] = []  # the AOT build's (native.load_kernels), once loaded


def lend_cores(fn, pools: list[KernelPool] = POOL):
    """``fn`` (a call into numpy's BLAS) wrapped so that the AOT pool's helpers sleep
    while it runs instead of spinning out their ~2 ms (native_pool.SPIN) after the last
    kernel: BLAS runs its own threads, and a spinning helper held the core one of them
    needed. MobileNetV2 fp32 at 2 threads, whose classifier is a BLAS GEMV, had a P99 of
    8.1-10.6 ms on a 4.6-5.3 ms median (6.0-6.7 with BLAS held to one thread). The next
    kernel wakes them (native_pool._run_job). Without the AOT pool (the JIT's numba
    threads) ``fn`` is returned as it is."""

    def call(*args, **kwargs):
        if not pools:
            return fn(*args, **kwargs)
        st = pools[0].state
        st[POOL_PARK] = 1
        try:
            return fn(*args, **kwargs)
        finally:
            st[POOL_PARK] = 0

    return call
