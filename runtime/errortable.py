"""Render the quantization error table stored in a bundle (used by build and info)."""

from __future__ import annotations


def format_error_table(table: dict, limit: int | None = None) -> str:
    """Every layer in graph order, or with ``limit`` the worst ``limit`` of them; then the
    end-to-end lines (and a language model's KL divergence and perplexities)."""
    rows = table["layers"]
    lines = [f"{'layer':<40} {'op':<15} {'rel L2':>10} {'cosine':>10}"]
    shown = rows if limit is None else sorted(rows, key=lambda r: -r["rel_l2"])[:limit]
    for r in shown:
        lines.append(
            f"{r['node'][:40]:<40} {r['op']:<15} {r['rel_l2']:>10.2e} {r['cosine']:>10.6f}"
        )
    if limit is not None and len(rows) > limit:
        lines.append(f"... the worst {limit} of {len(rows)} layers shown")
    for o, v in table["outputs"].items():
        lines.append(f"end-to-end {o}: rel L2 {v['rel_l2']:.3e}, cosine {v['cosine']:.6f}")
    if "kl" in table:
        ppl = (
            f"; perplexity {table['ppl']:.3f} (fp32 {table['ppl_fp32']:.3f})"
            if table.get("ppl") is not None
            else ""
        )
        lines.append(
            f"next token over {table['tokens']} tokens: mean KL {table['kl']:.4g} "
            f"(P99 {table['kl_p99']:.4g}), top-1 agreement {table['top1']:.3f}{ppl}"
        )
    return "\n".join(lines)
