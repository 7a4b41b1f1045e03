"""Choose each convolution's algorithm at pack time (the bundle carries the choice).

3x3 stride-1 convolutions become ``conv_wino`` nodes, whose weights are stored
Winograd-transformed (kernels/winograd.py), when the node will run on the CPU backend.
The rule is from `scripts/bench_conv_algo.py` on ResNet-18's layer shapes (1 thread,
median speed-up over direct on this project's 2-core Xeon, channels-last Winograd):

- F(4x4, 3x3) for outputs of at least 28x28: 4x fewer multiplies and enough tiles
  (>= 49) per GEMM (1.99x at 64ch 56x56, 1.96x at 128ch 28x28);
- F(2x2, 3x3) for outputs from 14x14 to 27x27: 2.25x fewer multiplies, and F(4x4)
  there has too few tiles for its 4x larger U (1.58x at 256ch 14x14; F(4x4) 1.25x);
- direct (im2col + GEMM) below 14x14, where U streams from memory for a few tiles
  (512ch 7x7: F(2x2) 1.01x, F(4x4) 0.68x), below 16 input or output channels, where
  the transforms cost more than the multiplies they save, and for int8 and int4
  weights (their per-channel or per-group scales cannot cover the transformed ones).

fp16 and bf16 weights are transformed from their stored values and U is rounded back
to the same type (kernels/winograd.py WEIGHT_TYPES), which the GEMM widens as it packs
U. Transformed weights take (a/3)^2 times the bytes of the plain ones: 1.8x for
F(2x2), 4x for F(4x4).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..kernels.registry import wants
from ..kernels.winograd import WEIGHT_TYPES, transform_weights
from ..kernels.wtypes import DEQUANTIZE, QUANTIZE
from .ir import Graph, Node

MIN_CHANNELS = 16
CONV_ALGOS = ("auto", "direct")


def winograd_tile(node: Node, g: Graph) -> int | None:
    """The Winograd tile size m for this node, or None to keep the direct conv."""
    if node.op != "conv":
        return None
    w = g.consts.get(node.input("w"))
    if w is None or g.wtype(node.input("w")) not in WEIGHT_TYPES or w.shape[2:] != (3, 3):
        return None
    a = node.attrs
    if a["group"] != 1 or list(a["strides"]) != [1, 1] or list(a["dilations"]) != [1, 1]:
        return None
    if min(w.shape[0], w.shape[1]) < MIN_CHANNELS:
        return None
    oh, ow = g.shapes[node.outputs[0]][2:]
    side = min(oh, ow)
    if side >= 28:
        return 4
    if side >= 14:
        return 2
    return None


def choose_conv_algorithms(g: Graph, backends: Sequence[str], algo: str = "auto") -> int:
    """Rewrite eligible convs as ``conv_wino`` in place; returns how many were rewritten.

    Only when the target's first backend asks for the pass (kernels/registry.py's
    backend table: the cpu backend does): the CUDA path keeps plain
    convs, and ``algo="direct"`` keeps every conv as imported.
    """
    if algo not in CONV_ALGOS:
        raise ValueError(f"conv algorithm {algo!r}; choose from {', '.join(CONV_ALGOS)}")
    if algo == "direct" or not wants(backends, "winograd"):
        return 0
    n = 0
    for node in g.nodes:
        m = winograd_tile(node, g)
        if m is None:
            continue
        wname = node.input("w")
        uname = f"{wname}.wino{m}"
        wt = g.wtype(wname)
        u = transform_weights(DEQUANTIZE[wt](g.consts[wname], None), m)
        g.set_const(uname, QUANTIZE[wt](u, 0)[0], wt)
        node.set_input("w", uname)
        node.op = "conv_wino"
        node.attrs = {**node.attrs, "tile": m}
        n += 1
    if n:
        g.remove_dead()  # the untransformed weights, unless another node shares them
    return n
