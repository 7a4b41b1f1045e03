"""The mixed-precision search (packager/precision.py) on stand-in executors: which
weights it keeps float32 and when it stops. The real models that use it are in
tests/test_e2e_models.py (PP-OCRv4 detector and recogniser)."""

from __future__ import annotations

import numpy as np
import pytest
from edgepack.packager import precision
from edgepack.packager.ir import Graph, Node

pytestmark = pytest.mark.cpu

REF = np.linspace(1.0, 2.0, 64)


class _Exec:
    """An executor whose output is REF plus noise of a given size."""

    outputs = [{"name": "y"}]

    def __init__(self, err: float, seed: int = 0) -> None:
        self.out = REF + err * np.random.default_rng(seed).standard_normal(REF.size)

    def run(self, feed):
        return {"y": self.out}


def _graph(names: list[str]) -> Graph:
    consts = {n: np.zeros(10, np.float32) for n in names}
    return Graph(nodes=[], inputs=[], outputs=["y"], shapes={}, consts=consts)


def _search(costs: dict[str, float], noise_floor: float = 0.0):
    """Each quantized weight adds its cost to the output's error; ``noise_floor`` is
    error that no kept layer removes (a ranked output's reordering)."""
    names = list(costs)
    calls: list[set[str]] = []

    def executor_for(keep: set[str]):
        calls.append(set(keep))
        err = noise_floor + sum(c for n, c in costs.items() if n not in keep)
        return _Exec(err, seed=1)

    ref = _Exec(0.0)
    start = precision.output_cosine(ref, executor_for(set()), [{}], ["y"])
    keep, cos = precision.keep_sensitive(_graph(names), names, executor_for, ref, [{}],
                                         0.99, lambda s: None, start=start)  # fmt: skip
    return keep, cos, start


def test_the_most_sensitive_layers_are_kept_until_the_target():
    costs = {f"w{i}": 0.001 for i in range(12)} | {"bad": 0.3, "worse": 0.5}
    keep, cos, start = _search(costs)
    assert start < 0.99 <= cos
    assert keep[:2] == ["worse", "bad"] and len(keep) <= 3


def test_a_search_that_gains_nothing_keeps_nothing():
    # every layer costs little; the output's error is a floor no layer removes
    keep, cos, start = _search({f"w{i}": 1e-4 for i in range(12)}, noise_floor=0.4)
    assert start < 0.99 and keep == [] and cos == start


def test_it_stops_after_patience_without_gain():
    costs = {f"w{i}": 1e-4 for i in range(40)}
    seen = []
    orig = precision.output_cosine

    def counting(*a, **k):
        seen.append(1)
        return orig(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "output_cosine", counting)
        _search(costs, noise_floor=0.4)
    # the start, one per layer's sensitivity, then PATIENCE greedy steps at most
    assert len(seen) == 1 + 40 + precision.PATIENCE


def test_a_ranked_output_is_measured_where_the_ranking_reads():
    # a detector's NMS-free head in miniature: scores ranked by TopK, boxes gathered
    # by its indices, both concatenated into the output; a second, plain output
    f = dict.fromkeys(["feat", "scores", "boxes", "best", "idx", "picked", "det",
                       "logits", "cls"], (1, 8))  # fmt: skip
    nodes = [
        Node("unary", "score", ["feat"], ["scores"], {"kind": "sigmoid"}),
        Node("unary", "box", ["feat"], ["boxes"], {"kind": "exp"}),
        Node("topk", "rank", ["scores"], ["best", "idx"], {"axis": -1, "k": 4, "largest": 1}),
        Node("gather_elements", "pick", ["boxes", "idx"], ["picked"], {"axis": -1}),
        Node("concat", "out", ["picked", "best", "w"], ["det"], {"axis": -1}),
        Node("unary", "head", ["feat"], ["logits"], {"kind": "neg"}),
        Node("argmax", "top1", ["logits"], ["cls"], {"axis": -1, "keepdims": 0}),
    ]
    g = Graph(nodes=nodes, inputs=["x"], outputs=["det", "logits", "cls"], shapes=f,
              consts={"w": np.zeros((1, 8), np.float32)},
              dtypes={"idx": "i64", "cls": "i64"})  # fmt: skip
    # the constant and the integer indices are not measured; each tensor once
    assert precision.measured_tensors(g) == ["boxes", "scores", "logits"]
    g.outputs = ["logits"]
    assert precision.measured_tensors(g) == ["logits"]
    # a ranking of the graph's input reads nothing the quantized layers change
    g.nodes[2].inputs = ["x"]
    g.outputs = ["best"]
    assert precision.measured_tensors(g) == ["best"]
