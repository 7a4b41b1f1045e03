"""Mixed precision at pack time: the layers whose quantization costs the outputs the
most stay float32 until the quantized bundle's outputs reach a cosine target on the
calibration inputs (``--min-cosine``, default 0.99 for the weight-quantized modes).

Each quantized weight's sensitivity is the output cosine with that weight alone
quantized (the rest float32); the most sensitive are kept float32 one at a time, the
whole bundle measured again after each, until the target (with a margin) is met or
no layer fits in ``MAX_KEPT_FRACTION`` of all quantized weights any more (then the
build says so and goes on).

An output computed from a ranking (TopK, ArgMax: which elements, not how large they
are) is measured where the ranking reads its values (``measured_tensors``): YOLO26's
NMS-free head takes the top 300 of 8400 x 80 near-tied scores, so one reordered pair
moves its output's cosine by more than any layer's quantization does. Measured on
it (weight-only int8, random weights): the output's cosine sat at 0.90 whatever was
kept; measured at the scores the TopK reads, the search keeps 13 layers (2.2 MB) and
the output's ranked scores reach cosine 0.996 with ORT's (median of 16 held-out
images; 0.944 before).

Why sensitivity and not each layer's own error: a few layers dominate. Measured on
PP-OCRv4's detector (46 quantized convs, weight-only int8, two text pages): output
cosine 0.984 with all quantized; one 96x96 pointwise conv alone costs 0.0038 of it
and three more 0.001 each; keeping the worst two float32 (11.5 K of 2.3 M weights)
gives 0.996. Rescaling the weights by a clipping search instead (MSE-optimal
per-channel scales) moved it to 0.985 only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..kernels.ops import WEIGHT_OPS
from .ir import Graph
from .quantize import ErrorAcc

MAX_KEPT_FRACTION = 0.25  # of the quantized weights' elements
# The search aims past the target on the calibration inputs (halfway to 1: 0.995 for
# 0.99), since they are a sample: on the OCR detector, 0.9909 on four calibration
# pages was 0.9906 on a held-out page; 0.997 on them gives 0.996.
AIM_MARGIN = 0.5
SENSITIVITY_FEEDS = 2  # calibration inputs per single-layer measurement
# The greedy search stops after this many kept layers in a row that did not raise the
# best cosine by GAIN, and the bundle keeps only the best prefix found. YOLO26's
# NMS-free head, measured at its ranked output (before measured_tensors) sat at 0.898
# whatever was kept: the search had kept 24 layers (2.4 MB of 5.4 MB fp32) and ended
# at 0.897, for 146 s of build.
PATIENCE = 3
GAIN = 1e-4
# Ops whose integer output says which elements won, not by how much: what is computed
# from it jumps when near ties trade places.
SELECTION_OPS = frozenset({"topk", "argmax"})


def quantized_weights(g: Graph, q: Graph) -> list[str]:
    """The weights of ``g``'s weight ops that ``q`` (its quantized copy) stores in
    another type than float32, in graph order."""
    seen: list[str] = []
    for n in g.nodes:
        if n.op in WEIGHT_OPS:
            w = n.input("w")
            if w in q.consts and q.wtype(w) != "f32" and w not in seen:
                seen.append(w)
    return seen


def measured_tensors(g: Graph) -> list[str]:
    """The tensors the search measures the bundle's cosine on: each output of ``g``,
    except that an output computed from a ranking (a SELECTION_OPS node's result, and
    whatever is computed from it) is replaced by the float tensors from outside the
    ranked region that it reads: the scores a TopK ranks, the boxes its indices gather.
    What layers after a ranking cost is then left out of the search."""
    ranked: dict[str, set[str]] = {}  # ranked tensor -> the unranked floats it reads
    for n in g.nodes:  # topological order
        ins = [t for t in n.inputs if t]
        if n.op not in SELECTION_OPS and not any(t in ranked for t in ins):
            continue
        reads = {t for t in ins if t not in ranked and t not in g.consts
                 and t not in g.inputs and g.dtype(t) == "f32"}  # fmt: skip
        for t in ins:
            reads |= ranked.get(t, set())
        for o in n.outputs:
            ranked[o] = reads
    out: list[str] = []
    for o in g.outputs:
        for t in sorted(ranked.get(o) or {o}):
            if t not in out:
                out.append(t)
    return out


def _tensors(executor, feed: Mapping[str, np.ndarray], want: set[str]) -> dict:
    """The tensors in ``want`` (outputs or intermediates) of one run."""
    if want <= {o["name"] for o in executor.outputs}:
        return executor.run(feed)
    got: dict[str, np.ndarray] = {}
    executor.run_traced(feed, lambda t, v: got.__setitem__(t, v) if t in want else None)
    missing = want - got.keys()
    if missing:
        raise KeyError(f"tensors {sorted(missing)} are not produced by the bundle's steps")
    return got


def output_cosine(ref_exec, q_exec, feeds: Sequence[Mapping[str, np.ndarray]],
                  tensors: Sequence[str]) -> float:  # fmt: skip
    """The lowest cosine over ``tensors`` (outputs, or what measured_tensors names) of
    ``q_exec`` against ``ref_exec``, summed over ``feeds``."""
    accs = {t: ErrorAcc() for t in tensors}
    for f in feeds:
        ref, got = _tensors(ref_exec, f, set(tensors)), _tensors(q_exec, f, set(tensors))
        for t in tensors:
            accs[t].add(np.asarray(ref[t]), np.asarray(got[t]))
    return min(a.cosine() for a in accs.values())


def keep_sensitive(
    g: Graph,
    quantized: Sequence[str],
    executor_for: Callable[[set[str]], object],
    ref_exec,
    feeds: Sequence[Mapping[str, np.ndarray]],
    target: float,
    log: Callable[[str], None],
    start: float = 0.0,
    tensors: Sequence[str] | None = None,
) -> tuple[list[str], float]:
    """The weights to keep float32 (most sensitive first) and the output cosine the
    bundle reaches with them kept. ``executor_for(keep)`` builds the quantized
    bundle's executor with the weights in ``keep`` left float32; ``start`` is the
    cosine with none kept (an empty list comes back when no prefix beats it);
    ``tensors``: what is measured (the outputs by default)."""
    outputs = list(tensors or g.outputs)
    probe = list(feeds[:SENSITIVITY_FEEDS])
    every = set(quantized)
    sens = []
    log(f"      measuring {len(quantized)} layers' sensitivity on {len(probe)} input(s)")
    for w in quantized:
        alone = output_cosine(ref_exec, executor_for(every - {w}), probe, outputs)
        sens.append((1.0 - alone, w))
    sens.sort(key=lambda t: -t[0])
    total = sum(int(g.consts[w].size) for w in quantized)
    aim = 1.0 - (1.0 - target) * AIM_MARGIN
    keep: list[str] = []
    best, best_n, stale = start, 0, 0
    budget = MAX_KEPT_FRACTION * total
    for _, w in sens:
        if sum(int(g.consts[k].size) for k in keep) + int(g.consts[w].size) > budget:
            continue  # too large to keep: the next most sensitive may do
        keep.append(w)
        cos = output_cosine(ref_exec, executor_for(set(keep)), feeds, outputs)
        if cos > best + GAIN:
            best, best_n, stale = cos, len(keep), 0
        else:
            stale += 1
        if cos >= aim or stale >= PATIENCE:
            break
    keep = keep[:best_n]
    if best < target:
        why = (f"no gain in {PATIENCE} more" if stale >= PATIENCE
               else f"at most {MAX_KEPT_FRACTION:.0%} of the weights")  # fmt: skip
        log(f"      output cosine {best:.4f} < {target} with {len(keep)} float32 layer(s) "
            f"({why})")  # fmt: skip
    return keep, best
