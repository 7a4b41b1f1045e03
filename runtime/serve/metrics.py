"""Counters and latency windows the agent publishes on its metrics topic."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque

import numpy as np


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Metrics:
    def __init__(self, window: int = 2048) -> None:
        self.started = time.time()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._latency = deque(maxlen=window)  # ms, arrival -> answer published
        self._lock = threading.Lock()

    def inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1
            self.counts["error"] += 1

    def latency(self, ms: float) -> None:
        self._latency.append(ms)

    def snapshot(self, **extra) -> dict:
        with self._lock:
            counts, errors = dict(self.counts), dict(self.errors)
        lat = np.asarray(self._latency, dtype=np.float64)
        pct = (
            {
                "p50": round(float(np.percentile(lat, 50)), 3),
                "p99": round(float(np.percentile(lat, 99)), 3),
                "n": int(lat.size),
            }
            if lat.size
            else {"p50": None, "p99": None, "n": 0}
        )
        return {
            "v": 1,
            "ts": round(time.time(), 3),
            "uptime_s": round(time.time() - self.started, 1),
            "jobs": {
                k: counts.get(k, 0)
                for k in ("received", "ok", "error", "duplicate", "no_reply", "partial")
            },
            "errors": errors,
            "latency_ms": pct,
            "rss_bytes": rss_bytes(),
            **extra,
        }
