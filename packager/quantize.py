"""Weight quantization and the fp32-vs-quantized error table.

``int8``: symmetric, per output channel (axis 0), int8 in [-127, 127] with float32
scales; the runtime keeps activations in float32 (see docs/quantization.md for the
measurement behind that choice). ``fp16``: weights stored as IEEE half. Biases and
any non-weight constants stay float32.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np

from .ir import Graph

MODES = ("fp32", "fp16", "int8")
WEIGHT_OPS = ("conv", "dwconv", "linear")
# Layers with fewer weights than this stay fp32: they hold a sliver of the bytes but,
# per weight, add the most error (measured on the rapidocr MobileNetV3 classifier:
# int8 top-1 agreement with fp32 went from 191/200 to 196/200 for +28 KB).
DEFAULT_MIN_WEIGHTS = 1024


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: w ~= q * scale[c]."""
    flat = w.reshape(w.shape[0], -1).astype(np.float64)
    amax = np.abs(flat).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    q = np.clip(np.rint(flat / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(w.shape), scale.astype(np.float32)


def quantize_graph(g: Graph, mode: str, min_weights: int = DEFAULT_MIN_WEIGHTS) -> Graph:
    """A copy of ``g`` whose conv/linear weights (those with at least ``min_weights``
    elements) are stored in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"--quant {mode!r}; choose from {', '.join(MODES)}")
    q = copy.deepcopy(g)
    if mode == "fp32":
        return q
    for node in q.nodes:
        if node.op not in WEIGHT_OPS:
            continue
        wname = node.inputs[1]
        w = q.consts[wname]
        if w.size < min_weights:
            continue
        if mode == "fp16":
            q.consts[wname] = w.astype(np.float16)
            continue
        qw, scale = quantize_int8(w)
        q.consts[wname] = qw
        sname = wname + ".scale"
        q.consts[sname] = scale
        node.inputs = (node.inputs + [""] * 4)[:3] + [sname] + node.inputs[4:]
    q.remove_dead()
    return q


def _rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    den = float(np.linalg.norm(ref.astype(np.float64)))
    num = float(np.linalg.norm(ref.astype(np.float64) - got.astype(np.float64)))
    return num / den if den > 0 else num


def _cosine(ref: np.ndarray, got: np.ndarray) -> float:
    a, b = ref.reshape(-1).astype(np.float64), got.reshape(-1).astype(np.float64)
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / den) if den > 0 else 1.0


def error_table(
    ref_traces: Sequence[Mapping[str, np.ndarray]],
    q_traces: Sequence[Mapping[str, np.ndarray]],
    nodes: Sequence[dict],
    outputs: Sequence[str],
) -> dict:
    """Per-layer relative L2 / cosine of quantized vs fp32 over all calibration inputs."""
    rows = []
    for node in nodes:
        for t in node["outputs"]:
            ref = np.concatenate([tr[t].reshape(-1) for tr in ref_traces])
            got = np.concatenate([tr[t].reshape(-1) for tr in q_traces])
            rows.append(
                {
                    "node": node["name"],
                    "op": node["op"],
                    "tensor": t,
                    "rel_l2": _rel_l2(ref, got),
                    "cosine": _cosine(ref, got),
                }
            )
    end = {}
    for o in outputs:
        ref = np.concatenate([tr[o].reshape(-1) for tr in ref_traces])
        got = np.concatenate([tr[o].reshape(-1) for tr in q_traces])
        end[o] = {"rel_l2": _rel_l2(ref, got), "cosine": _cosine(ref, got)}
    worst = max((v["rel_l2"] for v in end.values()), default=0.0)
    return {"layers": rows, "outputs": end, "max_output_rel_l2": worst}
