"""``edgepack bench`` for language-model bundles, in llama-bench's terms.

pp<N>: one prompt of N tokens fed from an empty context (tokens per second of the whole
prefill); tg<N>: N decode steps, from an empty context or after ``depth`` tokens of
it (tg128 @ d512), with the P99 of a single step. Medians over ``reps`` repeats. The
tokens are seeded random ids: speed does not depend on them. ``--profile`` times every
node of the decode step (at the first depth) and of one prompt chunk instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .llm import LLMSession
from .profile import format_profile, profile


@dataclass
class BenchRow:
    test: str
    tps: float  # median tokens per second
    spread: float  # (max - min) / 2 over the repeats, tokens per second
    p99_ms: float | None  # one decode step's 99th percentile (tg rows)


def _tokens(s: LLMSession, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, s.vocab, n)]


def bench_llm(
    s: LLMSession, pp: int = 512, tg: int = 128, depths=(0, 512, 2048), reps: int = 3
) -> list[BenchRow]:
    """The rows llama-bench prints for ``-p pp -n tg -d depths``, where the context
    allows them (depth + tg within the bundle's --ctx)."""
    rows = []
    clock = time.perf_counter
    if 0 < pp <= s.ctx:
        toks, tps = _tokens(s, pp, 0), []
        for _ in range(reps):
            s.reset(0)
            t = clock()
            s.prefill(toks)
            tps.append(pp / (clock() - t))
        rows.append(_row(f"pp{pp}", tps, None))
    for d in depths:
        if tg < 1 or d + tg > s.ctx:
            continue
        ctx_toks, steps_tok = _tokens(s, d, 1), _tokens(s, tg, 2)
        tps, steps = [], []
        for _ in range(reps):
            s.reset(0)
            if d:
                s.prefill(ctx_toks)
            t0 = clock()
            for tok in steps_tok:
                t = clock()
                s.step(tok)
                steps.append(clock() - t)
            tps.append(tg / (clock() - t0))
        p99 = float(np.percentile(steps, 99)) * 1e3
        rows.append(_row(f"tg{tg}" + (f" @ d{d}" if d else ""), tps, p99))
    return rows


def _row(test: str, tps: list[float], p99: float | None) -> BenchRow:
    return BenchRow(test, float(np.median(tps)), (max(tps) - min(tps)) / 2, p99)


def format_bench(rows: list[BenchRow]) -> str:
    out = [f"{'test':<16} {'tok/s':>14} {'P99 ms/token':>13}"]
    for r in rows:
        p99 = f"{r.p99_ms:13.2f}" if r.p99_ms is not None else f"{'':>13}"
        out.append(f"{r.test:<16} {r.tps:>8.1f} ± {r.spread:<4.1f} {p99}")
    return "\n".join(out)


def profile_llm(s: LLMSession, depth: int = 0, runs: int = 20) -> str:
    """Per-node times of the decode step after ``depth`` tokens of context, then of one
    prompt chunk at the same depth (runtime/profile.py's table for each)."""
    depth = max(0, min(depth, s.ctx - s.chunk - 1))
    s.reset(0)
    if depth:
        s.prefill(_tokens(s, depth, 1))
    f = s._feeds["decode"]
    f["slot"].fill(-1)
    f["ids"][0], f["pos"][0], f["slot"][0] = 1, depth, 0  # the step at position depth
    decode = profile(s.decode, f, runs)
    p = s._feeds["prefill"]
    p["ids"][:] = 1
    p["pos"][:] = np.arange(depth, depth + s.chunk)
    p["slot"][:] = 0
    prefill = profile(s.prefill_ex, p, max(3, runs // 4))
    s.reset(0)
    return (
        f"decode step at depth {depth}:\n{format_profile(decode)}\n\n"
        f"prompt chunk of {s.chunk} tokens at depth {depth}:\n{format_profile(prefill)}"
    )
