"""Weight quantization and the fp32-vs-quantized error table.

Each ``--quant`` mode is a row of the weight-type table (kernels/wtypes.py), which
holds its quantize and dequantize references: ``int8`` symmetric per output channel,
``int4`` symmetric group-wise along the reduction axis with fp16 scales, ``fp16`` and
``bf16``. The runtime keeps activations in float32 (see docs/quantization.md for the
measurement behind that choice). Biases and any non-weight constants stay float32.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np

from ..kernels.ops import WEIGHT_OPS
from ..kernels.wtypes import DEFAULT_GROUP, QUANT_MODES, QUANTIZE, WTYPES, by_quant
from .ir import Graph

MODES = QUANT_MODES  # the --quant choices: one per row of kernels/wtypes.py
# Layers with fewer weights than this stay fp32: they hold a sliver of the bytes but,
# per weight, add the most error (measured on the rapidocr MobileNetV3 classifier:
# int8 top-1 agreement with fp32 went from 191/200 to 196/200 for +28 KB).
DEFAULT_MIN_WEIGHTS = 1024
# ...unless they compute int8 x int8 and do this many multiply-adds a run: then their
# cost is their activations, not their weights. Measured: MobileNetV2's first three
# convs and one depthwise (288-864 weights, 2.7-10.8 M MACs at 112x112 and 56x56) took
# 4.04 -> 3.41 ms a run on one core in int8 x int8, output cosine 0.99946; the rapidocr
# classifier's small layers (at most 0.5 M MACs) stay fp32, which keeps its top-1
# agreement on noise lines at 194/200 (184 with them int8; 200/200 on rendered text
# either way).
INT8_ACT_MIN_MACS = 1_000_000
# The row a weight falls back to when its mode's row does not take its op: int4 keeps
# depthwise convs in int8 (their reduction is kh*kw = 9 taps a channel, less than one
# group of 32, so a group scale would be one scale per 9 weights).
FALLBACK = {"i4": "i8"}


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: w ~= q * scale[c]."""
    return QUANTIZE["i8"](w, 0)


def _stored_type(mode_type: str, ops: set[str]) -> str | None:
    """The type a weight read by nodes of ``ops`` is stored as under a mode whose row is
    ``mode_type``: that row if it takes every op, else its fallback row if that does,
    else None (the weight stays float32)."""
    for t in (mode_type, FALLBACK.get(mode_type)):
        if t is not None and ops <= set(WTYPES[t].ops):
            return t
    return None


def busy_small_weights(g: Graph, min_weights: int, min_macs: int = INT8_ACT_MIN_MACS) -> list[str]:
    """The weights under ``min_weights`` whose readers do at least ``min_macs``
    multiply-adds a run (output elements x weights per output channel): the ones int8
    activations quantize anyway (INT8_ACT_MIN_MACS says why)."""
    macs: dict[str, int] = {}
    for node in g.nodes:
        if node.op not in WEIGHT_OPS or node.op == "embed":
            continue
        w = g.consts[node.input("w")]
        if w.size < min_weights:
            out = int(np.prod(g.shapes[node.outputs[0]]))
            macs[node.input("w")] = macs.get(node.input("w"), 0) + out // w.shape[0] * w.size
    return [name for name, n in macs.items() if n >= min_macs]


def quantize_graph(
    g: Graph,
    mode: str,
    min_weights: int = DEFAULT_MIN_WEIGHTS,
    group: int = DEFAULT_GROUP,
    overrides: Mapping[str, str] | None = None,
) -> Graph:
    """A copy of ``g`` whose weight-op weights (those with at least ``min_weights``
    elements) are stored as ``mode``'s row of the weight-type table (``overrides``: a
    mode per weight name, whatever its size, e.g. an LLM's embedding table, or the small
    layers int8 activations take); ``group`` is the int4 group size. A weight read by several
    nodes (a tied embedding and output projection) gets one type all of them take."""
    q = copy.deepcopy(g)
    readers: dict[str, list] = {}
    for node in q.nodes:
        if node.op in WEIGHT_OPS:
            readers.setdefault(node.input("w"), []).append(node)
    for wname, nodes in readers.items():
        named = wname in (overrides or {})
        row = by_quant((overrides or {}).get(wname, mode))
        w = q.consts[wname]
        if row.name == "f32" or (w.size < min_weights and not named) or q.wtype(wname) != "f32":
            continue
        t = _stored_type(row.name, {n.op for n in nodes})
        if t is None:
            continue
        stored, scale = QUANTIZE[t](w, group)
        q.set_const(wname, stored, t)
        sname = None
        if scale is not None:
            sname = wname + ".scale"
            q.set_const(sname, scale)
        for node in nodes:
            if sname is not None:
                node.set_input("scale", sname)
            if t == "i4":  # stored canonical [N, Kp/2]: the logical shape goes with the node
                node.attrs = {**node.attrs, "wshape": list(w.shape)}
    q.remove_dead()
    return q


class ErrorAcc:
    """Running sums for one tensor's relative L2 and cosine, over runs: nothing of a
    run is kept (an encoder's 1 GB of intermediates a calibration input, 8 of them, had
    filled the memory when every trace was held)."""

    def __init__(self) -> None:
        self.dd = self.rr = self.gg = self.rg = 0.0

    def add(self, ref: np.ndarray, got: np.ndarray) -> None:
        r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
        with np.errstate(invalid="ignore"):  # equal infinities (a mask's -inf) differ by 0
            d = np.where(r == g, 0.0, r - g)
        self.dd += float(d @ d)
        self.rr += float(r @ r)
        self.gg += float(g @ g)
        self.rg += float(r @ g)

    def rel_l2(self) -> float:
        """|ref - got| / |ref|; the absolute |ref - got| where ref is all zeros."""
        return (self.dd / self.rr) ** 0.5 if self.rr > 0 else self.dd**0.5

    def cosine(self) -> float:
        den = (self.rr * self.gg) ** 0.5
        return self.rg / den if den > 0 else 1.0


def error_table(ref_exec, q_exec, feeds: Sequence[Mapping[str, np.ndarray]],
                nodes: Sequence[dict], outputs: Sequence[str]) -> dict:  # fmt: skip
    """Per-layer relative L2 / cosine of quantized (``q_exec``) vs fp32 (``ref_exec``)
    over all calibration ``feeds``: one fp32 trace held at a time, the quantized run's
    tensors compared as they are produced."""
    accs: dict[str, ErrorAcc] = {}
    ref: dict[str, np.ndarray] = {}

    def visit(t: str, got: np.ndarray) -> None:
        if t in ref:  # not fused away in the fp32 graph (an int4 chain is not)
            accs.setdefault(t, ErrorAcc()).add(ref[t], got)

    for f in feeds:
        ref.clear()
        ref.update(ref_exec.run_traced(f))
        q_exec.run_traced(f, visit)
    ref.clear()
    rows = [{"node": n["name"], "op": n["op"], "tensor": t, "rel_l2": accs[t].rel_l2(),
             "cosine": accs[t].cosine()}
            for n in nodes for t in n["outputs"] if t in accs]  # fmt: skip
    end = {o: {"rel_l2": accs[o].rel_l2(), "cosine": accs[o].cosine()} for o in outputs}
    worst = max((v["rel_l2"] for v in end.values()), default=0.0)
    return {"layers": rows, "outputs": end, "max_output_rel_l2": worst}
