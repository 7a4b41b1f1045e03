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
# Two threads' register-only multiply-adds against one's (core_share): under SHARED_BELOW
# the two vCPUs ran on one physical core's arithmetic (SMT siblings, or one time-sliced).
# Measured 2026-12-07 on the EPYC VM, 2 ms loops every 2 s for 80 s: 1.9-1.97 in most
# probes, 1.0 in spells of 2-10 s (round trip 60-65 ns then: one core's L1), and 1.2-1.7
# in some, which are those spells starting or ending inside the probe.
SHARED_BELOW = 1.5
SHARE_TRIPS = 100_000  # about 2 ms of the loop on a Zen 4 core
_FMA: list = []
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


def _pinned(call, cpu: int, out: list[float], barrier: threading.Barrier | None = None) -> None:
    """call() on this thread pinned to cpu (after the barrier, if any); its time to out."""
    os.sched_setaffinity(0, {cpu})
    if barrier is not None:
        barrier.wait()
    t = time.perf_counter()
    call()
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
    helper = threading.Thread(target=_pinned, args=(lambda: pong(st, n), b, []))
    helper.start()
    try:
        _pinned(lambda: ping(st, n), a, out)
    finally:
        helper.join()
        os.sched_setaffinity(0, set(allowed))
    return out[0] / n * 1e9


def _fma_loop():
    if not _FMA:
        from bench_peak import fma_runner  # numba and llvmlite: only when probing

        _FMA.append(fma_runner())
    return _FMA[0]


def core_share(cpus: tuple[int, int] | None = None) -> float:
    """How many cores' arithmetic two threads get: a register-only multiply-add loop's
    throughput on both CPUs at once over its throughput on the first alone (about 2 on
    two physical cores, 1 on one core's SMT siblings). NaN with fewer than two CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return float("nan")
    a, b = cpus or (allowed[0], allowed[1])
    fn = _fma_loop()

    def loop():
        fn(SHARE_TRIPS)

    try:
        alone: list[float] = []
        _pinned(loop, a, alone)
        both: list[float] = []
        barrier = threading.Barrier(2)
        helper = threading.Thread(target=_pinned, args=(loop, b, both, barrier))
        helper.start()
        _pinned(loop, a, both, barrier)
        helper.join()
    finally:
        os.sched_setaffinity(0, set(allowed))
    return 2 * alone[0] / max(both)


def placement(rt_ns: float, share: float = float("nan")) -> str:
    """'shared' (one core's arithmetic for both vCPUs: core_share under SHARED_BELOW),
    else 'near', 'far' or '?' by the round trip."""
    if share < SHARED_BELOW:
        return "shared"
    if rt_ns < NEAR_NS:
        return "near"
    if rt_ns > FAR_NS:
        return "far"
    return "?"


def main() -> int:
    round_trip_ns(10)  # compile
    core_share()
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        rt, share = round_trip_ns(), core_share()
        print(f"{rt:6.0f} ns  {share:4.2f} cores  {placement(rt, share)}", flush=True)
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
