"""Per-op time of a bound executor (``edgepack bench --profile``).

Times each pre-bound step (one fused node: conv + bias + activation + residual is
one row) over repeated runs, so the next bottleneck is visible.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from .executor import Executor


def profile(ex: Executor, feeds: Mapping[str, np.ndarray], runs: int) -> list[dict]:
    """Median ms per node over ``runs`` runs, slowest first, with its share of the total."""
    ex.run_views(feeds)  # warm
    bound = [(node, step) for node, step in ex.bound if step is not None]
    times = np.zeros((runs, len(bound)))
    clock = time.perf_counter
    dev = ex.device
    sync = dev.synchronize  # GPU launches are asynchronous: time each to completion
    for r in range(runs):
        for dst, src in zip(ex._in_views, ex.check_inputs(feeds)):
            dev.copy_in(dst, src)
        sync()
        for i, (_, step) in enumerate(bound):
            t = clock()
            step()
            sync()
            times[r, i] = clock() - t
    med = np.median(times, axis=0) * 1e3
    total = float(med.sum()) or 1.0
    rows = [
        {
            "node": node["name"],
            "op": node["op"],
            "kernel": node["kernel"]["name"],
            "dtype": node["kernel"]["dtype"],
            "ms": float(m),
            "share": float(m) / total,
        }
        for (node, _), m in zip(bound, med)
    ]
    return sorted(rows, key=lambda r: -r["ms"])


def format_profile(rows: list[dict], limit: int = 25) -> str:
    total = sum(r["ms"] for r in rows)
    by_op: dict[str, float] = {}
    for r in rows:
        key = f"{r['op']}/{r['dtype']}"
        by_op[key] = by_op.get(key, 0.0) + r["ms"]
    out = [
        f"per-op median time, sum {total:.3f} ms over {len(rows)} steps",
        "",
        f"{'op/dtype':<22} {'ms':>9} {'share':>7}",
    ]
    for k, v in sorted(by_op.items(), key=lambda kv: -kv[1]):
        out.append(f"{k:<22} {v:>9.3f} {v / total:>7.1%}")
    out += ["", f"{'node':<40} {'op':<15} {'kernel':<16} {'ms':>9} {'share':>7}"]
    for r in rows[:limit]:
        out.append(
            f"{r['node'][:40]:<40} {r['op']:<15} {r['kernel']:<16} {r['ms']:>9.3f} "
            f"{r['share']:>7.1%}"
        )
    if len(rows) > limit:
        out.append(f"... {len(rows) - limit} more steps")
    return "\n".join(out)
