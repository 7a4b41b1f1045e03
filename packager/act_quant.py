"""int8 activations for convs: calibrate each conv input's range, and turn int8 convs
into ``qconv`` nodes that multiply u8 activations by s8 weights (kernels/cpu/qgemm.py).

The scheme, and why (docs/quantization.md, "int8 activations"):
- activations u8, asymmetric, one scale and zero point per tensor, from the minimum and
  maximum over the calibration inputs with 0 always inside the range (ONNX Runtime's
  MinMax calibration and its QDQ default, u8 activations with s8 weights): after a ReLU
  the range starts at 0 and all 256 codes hold values. Zero is a code exactly, so the
  zero padding of a window is exact too;
- weights as they are: s8 symmetric per output channel (kernels/wtypes.py's int8);
- no ``reduce_range``: the kernels never multiply with saturating 16-bit sums (qgemm.py);
- the output stays float32, the requantization being the next conv's quantizing of its
  input (fused into the copy that pads it), so ops between convs (residual adds, pools,
  concats, activations we do not fuse) need no integer forms and add no error; but an
  output only int8 convs read is written as their u8 codes (``int8_codes``), which
  they read without that copy: the same codes, a quarter of the bytes.

Only the cpu backend asks for this (kernels/registry.py's ``act_quant`` pass); a conv
it cannot take (grouped, dilated along the width, not int8, channels-first) stays
weight-only int8.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ..kernels import layout as L
from .ir import Graph, Node

ACT_SCHEME = (
    "u8 asymmetric per tensor (min/max over the calibration inputs) x s8 "
    "symmetric per output channel, int32 sums, float32 outputs (u8 codes where only "
    "int8 convs read them)"
)


def u8_params(lo: float, hi: float) -> tuple[float, int]:
    """(scale, zero point) of u8 codes for the range [lo, hi] widened to hold 0."""
    lo, hi = min(0.0, float(lo)), max(0.0, float(hi))
    if not np.isfinite(lo) or not np.isfinite(hi):
        raise ValueError(f"activation range [{lo}, {hi}] is not finite")
    scale = float(np.float32((hi - lo) / 255.0)) if hi > lo else 1.0
    zero = int(np.clip(np.rint(-lo / scale), 0, 255))
    return scale, zero


def activation_ranges(
    executor, feeds: Sequence[Mapping[str, np.ndarray]], tensors: Iterable[str] | None = None
) -> dict[str, tuple[float, float]]:
    """{tensor: (min, max) of its finite values} over the runs of ``executor`` (fp32) on
    ``feeds``, for ``tensors`` (default: the inputs and every node's outputs)."""
    want = None if tensors is None else set(tensors)
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}

    def note(t: str, a: np.ndarray) -> None:
        if (want is None or t in want) and a.size:
            finite = a[np.isfinite(a)]
            if finite.size:
                lo[t] = min(lo.get(t, np.inf), float(finite.min()))
                hi[t] = max(hi.get(t, -np.inf), float(finite.max()))

    for f in feeds:
        for name, a in f.items():
            note(name, np.asarray(a, np.float32))
        executor.run_traced(f, note)
    return {t: (lo[t], hi[t]) for t in lo}


def _takes(g: Graph, n: Node) -> bool:
    a = n.attrs
    return (
        n.op == "conv"
        and L.is_nhwc(a)
        and a.get("group", 1) == 1
        and a.get("panel") == L.PANEL
        and not L.canonical_weights(a)
        and a["dilations"][1] == 1
        and g.wtype(n.input("w")) == "i8"
    )


def quantize_conv_inputs(g: Graph, ranges: Mapping[str, tuple[float, float]]) -> int:
    """Turn each int8 conv whose input has a calibrated range into a ``qconv`` (in
    place); returns how many."""
    done = 0
    for n in g.nodes:
        x = n.inputs[0] if n.inputs else ""
        if not _takes(g, n) or x not in ranges:
            continue
        s, z = u8_params(*ranges[x])
        w, co = n.input("w"), int(n.attrs["out_channels"])
        hwio = L.from_panels(g.consts[w], co)
        kh, kw, c, _ = hwio.shape
        name = w + ".dot4"
        if name not in g.consts:
            g.set_const(name, L.to_dot4_panels(hwio), "i8")
        npan = -(-co // L.PANEL)
        zw = np.zeros(npan * L.PANEL, np.int32)  # whole panels: the kernel loads vectors
        zw[:co] = -z * hwio.reshape(-1, co).astype(np.int64).sum(0)
        out = n.outputs[0]
        g.set_const(out + ".zw", zw)
        sw = g.consts[n.input("scale")].astype(np.float64)
        g.set_const(out + ".xscale", (np.float64(np.float32(s)) * sw).astype(np.float32))
        bias, res = n.input("bias"), n.input("residual")
        n.op = "qconv"
        n.inputs = [x, name, bias, out + ".xscale", res, out + ".zw"]
        attrs = {k: v for k, v in n.attrs.items() if k != "panel"}
        n.attrs = attrs | {
            "kernel": [int(kh), int(kw)],
            "in_channels": int(c),
            "out_channels": co,
            "x_scale": float(np.float32(s)),
            "x_zero": z,
            "run4": L.dot4_run(kw, c),
        }
        done += 1
    if done:
        g.remove_dead()
    return done


CLAMPS = ("none", "relu", "clip")  # activations an int8 op applies before its codes


def _dw_takes(g: Graph, n: Node) -> bool:
    a = n.attrs
    return (
        n.op == "dwconv"
        and L.is_nhwc(a)
        and tuple(g.consts[n.input("w")].shape[:2]) == (3, 3)
        and g.wtype(n.input("w")) in ("f32", "i8")
        and not n.input("residual")
        and a.get("act", "none") in CLAMPS
    )


def int8_codes(g: Graph, ranges: Mapping[str, tuple[float, float]]) -> tuple[int, int]:
    """Write u8 codes where only int8 convs read them (in place; after
    ``quantize_conv_inputs``): a qconv, or a 3x3 depthwise conv (made a ``qdwconv``,
    kernels/cpu/qdw.py), whose output only qconvs read writes it as their u8 codes (its
    ``y_scale``, ``y_zero``: the readers' ``x_scale``, ``x_zero``, from the same
    calibrated range), so the readers skip their quantizing copy. A producer with
    another activation than relu or clip, an output of the graph, and a tensor anything
    else reads stay float32, and so does a depthwise conv's input (qdw.py says why).
    Returns (depthwise convs made qdwconv, tensors as u8)."""
    outputs = set(g.outputs)
    cons = g.consumers()

    def codes_out(n: Node) -> bool:
        t = n.outputs[0]
        readers = cons.get(t, [])
        return (
            (n.op == "qconv" or _dw_takes(g, n))
            and n.attrs.get("act", "none") in CLAMPS
            and t not in outputs
            and t in ranges
            and bool(readers)
            and all(r.op == "qconv" and r.inputs[0] == t and t not in r.inputs[1:]
                    for r in readers)  # fmt: skip
        )

    coded = [n for n in g.nodes if codes_out(n)]
    n_dw = 0
    for n in coded:
        t = n.outputs[0]
        s, z = u8_params(*ranges[t])
        if n.op == "dwconv":
            w, sc, bias = n.input("w"), n.input("scale"), n.input("bias")
            if not sc:  # float32 weights: the kernel multiplies by a scale all the same
                sc = t + ".wscale"
                g.set_const(sc, np.ones(g.consts[w].shape[3], np.float32))
            n.op = "qdwconv"
            n.inputs = [n.inputs[0], w, bias, sc]
            n_dw += 1
        n.attrs["y_scale"], n.attrs["y_zero"] = float(np.float32(s)), z
        g.dtypes[t] = "u8"
    return n_dw, len(coded)
