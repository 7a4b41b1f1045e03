"""Counters and latency windows: the MQTT agent publishes a JSON snapshot on its metrics
topic, the HTTP server renders the same counters in Prometheus' text format."""

from __future__ import annotations

import bisect
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


# Upper bounds (seconds) of the latency histogram's buckets: a digits CNN answers in
# 0.1 ms, a 640x640 detector in 100 ms, an LLM completion in seconds.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0)  # fmt: skip


HISTOGRAMS = {
    "request_duration_seconds": "Arrival to answer, by front.",
    "time_to_first_token_seconds": "Language models: arrival to the first token, by front.",
}


class Metrics:
    def __init__(self, window: int = 2048) -> None:
        self.started = time.time()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._latency = deque(maxlen=window)  # ms, arrival -> answer published
        self._lock = threading.Lock()
        # (histogram, front) -> [count per bucket (the last: +Inf)], [sum of seconds]
        self._hist: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        self.http: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)

    def inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1
            self.counts["error"] += 1

    def latency(self, ms: float, front: str = "mqtt") -> None:
        """One answered job's time from arrival to answer."""
        self._latency.append(ms)
        self.observe("request_duration_seconds", front, ms / 1e3)

    def observe(self, name: str, front: str, seconds: float) -> None:
        """One sample of histogram ``edgepack_<name>`` (HISTOGRAMS) for ``front``."""
        with self._lock:
            counts, total = self._hist.setdefault((name, front),
                                                  ([0] * (len(BUCKETS) + 1), [0.0]))  # fmt: skip
            counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            total[0] += seconds

    def request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.http[(method, route, status)] += 1

    def prometheus(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The counters, the latency histograms and ``gauges`` (name -> (help, value))
        in Prometheus' text exposition format (version 0.0.4)."""
        with self._lock:
            counts, errors, http = dict(self.counts), dict(self.errors), dict(self.http)
            hist = {f: (list(c), t[0]) for f, (c, t) in self._hist.items()}
        out: list[str] = []

        def family(name: str, kind: str, help_: str, rows: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in rows)

        family("edgepack_jobs_total", "counter", "Jobs by outcome, every front together.",
               [(f'{{outcome="{k}"}}', counts.get(k, 0))
                for k in ("received", "ok", "error", "duplicate", "partial")])  # fmt: skip
        family("edgepack_tokens_total", "counter", "Language models: tokens by kind.",
               [(f'{{kind="{k}"}}', counts.get(f"tokens_{k}", 0))
                for k in ("prompt", "prompt_cached", "generated")])  # fmt: skip
        family("edgepack_errors_total", "counter", "Error answers by protocol error code.",
               [(f'{{code="{_esc(k)}"}}', v) for k, v in sorted(errors.items())])  # fmt: skip
        family("edgepack_http_requests_total", "counter", "HTTP requests by route and status.",
               [(f'{{method="{m}",route="{_esc(r)}",code="{c}"}}', v)
                for (m, r, c), v in sorted(http.items())])  # fmt: skip
        for name, help_ in HISTOGRAMS.items():
            full = f"edgepack_{name}"
            out.append(f"# HELP {full} {help_}")
            out.append(f"# TYPE {full} histogram")
            for (h, front), (c, total) in sorted(hist.items()):
                if h != name:
                    continue
                acc = 0
                for le, n in zip((*map(str, BUCKETS), "+Inf"), c):
                    acc += n
                    out.append(f'{full}_bucket{{front="{front}",le="{le}"}} {acc}')
                out.append(f'{full}_sum{{front="{front}"}} {_num(total)}')
                out.append(f'{full}_count{{front="{front}"}} {acc}')
        gauges = {"edgepack_uptime_seconds": ("Seconds since start.", time.time() - self.started),
                  "edgepack_resident_memory_bytes": ("Resident set size.", rss_bytes()),
                  **gauges}  # fmt: skip
        for name, (help_, v) in gauges.items():
            family(name, "counter" if name.endswith("_total") else "gauge", help_, [("", v)])
        return "\n".join(out) + "\n"

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


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)
