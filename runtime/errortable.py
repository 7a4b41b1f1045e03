"""Render the quantization error table stored in a bundle (used by build and info)."""

from __future__ import annotations


def format_error_table(table: dict, limit: int | None = None) -> str:
    rows = table["layers"]
    lines = [f"{'layer':<40} {'op':<15} {'rel L2':>10} {'cosine':>10}"]
    shown = rows if limit is None else rows[:limit]
    for r in shown:
        lines.append(
            f"{r['node'][:40]:<40} {r['op']:<15} {r['rel_l2']:>10.2e} {r['cosine']:>10.6f}"
        )
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more layers")
    for o, v in table["outputs"].items():
        lines.append(f"end-to-end {o}: rel L2 {v['rel_l2']:.3e}, cosine {v['cosine']:.6f}")
    return "\n".join(lines)
