"""How far apart two vCPUs are right now: a cache line's round trip between them.

On the 2-core VMs these benchmarks run on, the host moves the two vCPUs between
physical cores. Measured with this probe (2026-12-07, AMD EPYC, Zen 4), the round
trip is either 80-120 ns (the same core complex, sharing its L3) or 320-390 ns
(different complexes: every line one thread wrote and the other reads crosses the
fabric), and the state lasts from seconds to minutes. Two independent 1-thread
engines, one per vCPU, ran as fast in either state (0.9-1.2x of solo), but a
2-thread engine, whose threads read what the other wrote every layer, did not:
MobileNetV2 int8 at 2 threads went from 1.9 to 3.3-4.0 ms (ORT QDQ from 2.1 to 2.8).
So a 2-thread figure from these machines means little without the state it was
measured in; bench_cnn.py probes before every round and reports both.

    python scripts/vcpu_probe.py            # a few probes, one per second
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

# Round trips below NEAR_NS: one core complex; above FAR_NS: two. Between: unclassified
# (none measured there so far; a probe that a scheduler tick interrupted lands high).
NEAR_NS, FAR_NS = 200.0, 250.0
_KERNELS: list = []  # (ping, pong), compiled on first use: bench_cnn's workers import
# this module for its constants and must not pay for numba


def _kernels():
    if not _KERNELS:
        from edgepack.kernels.cpu import atomics
        from numba import njit

        @njit(nogil=True)
        def pong(st, n):
            for i in range(n):
                while atomics.load(st, 0) != 2 * i + 1:
                    pass
                atomics.store(st, 0, 2 * i + 2)

        @njit(nogil=True)
        def ping(st, n):
            for i in range(n):
                atomics.store(st, 0, 2 * i + 1)
                while atomics.load(st, 0) != 2 * i + 2:
                    pass

        _KERNELS[:] = [ping, pong]
    return _KERNELS


def _pinned(fn, st, n: int, cpu: int, out: list[float]) -> None:
    os.sched_setaffinity(0, {cpu})
    t = time.perf_counter()
    fn(st, n)
    out.append(time.perf_counter() - t)


def round_trip_ns(n: int = 5000, cpus: tuple[int, int] | None = None) -> float:
    """Mean round trip (ns) of one cache line between two pinned threads
    over n exchanges (5000: about 0.5-2 ms). ``cpus``: the pair (default: the first two
    this process may run on). NaN with fewer than two usable CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return float("nan")
    a, b = cpus or (allowed[0], allowed[1])
    ping, pong = _kernels()
    st = np.zeros(16, np.int64)  # one line: the counter both threads write
    out: list[float] = []
    helper = threading.Thread(target=_pinned, args=(pong, st, n, b, []))
    helper.start()
    try:
        _pinned(ping, st, n, a, out)
    finally:
        helper.join()
        os.sched_setaffinity(0, set(allowed))
    return out[0] / n * 1e9


def placement(rt_ns: float) -> str:
    """'near', 'far' or '?' for a round trip."""
    if rt_ns < NEAR_NS:
        return "near"
    if rt_ns > FAR_NS:
        return "far"
    return "?"


def main() -> int:
    round_trip_ns(10)  # compile
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        rt = round_trip_ns()
        print(f"{rt:6.0f} ns  {placement(rt)}", flush=True)
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
