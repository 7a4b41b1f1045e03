"""Choose each activation's memory layout at pack time (the bundle carries it).

On CPU targets, convolutions and the ops between them run channels-last
(``attrs["layout"] = "nhwc"``, kernels/layout.py): channels are then the contiguous
axis the kernels vectorise, whatever the image size. Planar, MobileNetV2's 7x7 and
14x14 layers left up to a quarter of each vector empty, and its depthwise convs ran
2-5x slower than ONNX Runtime's channels-blocked ones (docs/cpu-kernels.md).

A conv (group 1 or depthwise) starts or extends a channels-last region; max pooling,
global average pooling and elementwise ops whose inputs are all channels-last extend
it. Where a region meets an op that only has a channels-first form, or a graph input
or output, a ``transpose`` node converts once; each tensor is converted at most once
each way. Conv weights are stored HWIO (``[kh, kw, C/group, Co]``) for these nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels import layout as L
from ..kernels import wtypes
from ..kernels.registry import wants
from .ir import Graph, Node

LAYOUTS = ("auto", "nchw")
STARTS = ("conv", "dwconv", "conv_wino")  # ops that open a channels-last region
JOINS = ("maxpool", "global_avgpool")  # ops that join one their input is already in
AGNOSTIC = ("unary", "binary")  # elementwise: any layout, as long as all inputs agree


def _starts(node: Node, g: Graph) -> bool:
    if node.op not in STARTS or len(g.shapes.get(node.inputs[0], ())) != 4:
        return False
    return node.op != "conv" or node.attrs.get("group", 1) == 1


def choose_layouts(g: Graph, backends: Sequence[str], layout: str = "auto") -> int:
    """Rewrite conv regions channels-last in place; returns how many nodes changed.

    Only when the target's first backend asks for the pass (kernels/registry.py's
    backend table: the cpu backend does; the CUDA kernels are
    channels-first), and never with ``layout="nchw"``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if layout == "nchw" or not wants(backends, "channels_last"):
        return 0
    last: set[str] = set()  # activations now held channels-last
    to_last: dict[str, str] = {}  # channels-first tensor -> its channels-last copy
    to_first: dict[str, str] = {}  # channels-last tensor -> its channels-first copy
    nodes: list[Node] = []
    changed = 0

    def convert(t: str, want_last: bool) -> str:
        cache, perm, suffix = (
            (to_last, L.TO_NHWC, ".nhwc") if want_last else (to_first, L.TO_NCHW, ".nchw")
        )
        if t not in cache:
            name = _fresh(g, t + suffix)
            g.shapes[name] = shape = tuple(g.shapes[t][p] for p in perm)
            if _pixel(g.shapes[t], not want_last):  # [N, C, 1, 1]: the same bytes
                nodes.append(
                    Node("reshape", f"{name}.reshape", [t], [name], {"shape": list(shape)})
                )
            else:
                nodes.append(
                    Node("transpose", f"{name}.transpose", [t], [name], {"perm": list(perm)})
                )
            cache[t] = name
        return cache[t]

    for node in g.nodes:
        acts = [i for i in node.inputs if i and i not in g.consts]
        if _starts(node, g):
            go = True
        elif node.op in JOINS:
            go = node.inputs[0] in last
        elif node.op in AGNOSTIC:
            go = _elementwise_goes_last(g, node, acts, last)
        else:
            go = False
        if not go:  # channels-first: convert any channels-last inputs back
            node.inputs = [convert(i, False) if i in last else i for i in node.inputs]
            nodes.append(node)
            continue
        idx = (
            range(len(node.inputs))
            if node.op in AGNOSTIC
            else L.activation_inputs(node.op, len(node.inputs))
        )
        for i in idx:
            t = node.inputs[i]
            if t in g.consts:  # a broadcast constant of an elementwise op, permuted once
                node.inputs[i] = _nhwc_const(g, t)
            elif t and t not in last:
                node.inputs[i] = convert(t, True)
        if node.op in L.WEIGHT_IN_HWIO and not L.canonical_weights(node.attrs):
            w = node.input("w")
            hw = w + ".hwio"
            if hw not in g.consts:
                hwio = np.ascontiguousarray(g.consts[w].transpose(L.HWIO_FROM_OIHW))
                g.set_const(hw, hwio, g.wtype(w))
            node.set_input("w", hw)
        if node.op not in AGNOSTIC:
            node.attrs = {**node.attrs, "layout": L.NHWC}
        if node.op in AGNOSTIC or L.output_is_nhwc(node.op):
            out = node.outputs[0]
            g.shapes[out] = tuple(g.shapes[out][p] for p in L.TO_NHWC)
            last.add(out)
        nodes.append(node)
        changed += 1
    # Graph outputs keep their names and channels-first shapes: a channels-last
    # producer writes a renamed tensor that a final transpose converts.
    for o in g.outputs:
        if o in last:
            inner = _fresh(g, o + ".nhwc")
            g.shapes[inner] = g.shapes.pop(o)
            for n in nodes:
                n.inputs = [inner if i == o else i for i in n.inputs]
                n.outputs = [inner if t == o else t for t in n.outputs]
            g.shapes[o] = tuple(g.shapes[inner][p] for p in L.TO_NCHW)
            back = {"perm": list(L.TO_NCHW)}
            nodes.append(Node("transpose", f"{o}.transpose", [inner], [o], back))
    g.nodes = nodes
    if changed:
        g.remove_dead()  # OIHW weights no other node reads
    return changed


# A float32 linear of at most this many multiply-adds a run stores its weights as
# panels and runs on the panel GEMM instead of BLAS plus an epilogue pass. Measured at
# 1 thread on a Zen 2 EPYC (gemmp over np.matmul + epilogue_cols): ViT's 17 rows x
# 64x192 0.60, 64x256 0.60, 256x64 0.58, 64x64 0.43; 4 x 384x384 (0.6M) 0.64; past
# about a million the BLAS kernel's blocking wins (17 x 384x384: 0.83 to 1.03 between
# runs, 33 x 128x512: 1.24, 128 x 384x384: 1.6-2.4).
LINEAR_PANEL_MAX_MACS = 1 << 20
# ... and a float32 one of at most this many rows whatever its size: few rows stream the
# weights once either way, and float32 has no GEMV of its own (kernels/cpu/gemv.py
# widens the other types), so BLAS's ran outside the kernel pool, whose helpers it then
# had to wait for or fight: MobileNetV2's 1-row 1280x1000 classifier 0.312 -> 0.238 ms
# at 1 thread; at 2 threads the model's P99 7.3-9.6 -> 5.0-6.6 ms, median 4.4-4.7 ->
# 4.3-4.8 (2026-12-07, AOT kernels, alternating processes).
LINEAR_PANEL_F32_ROWS = 8


def pack_panels(g: Graph) -> int:
    """Store GEMM weights as panels (kernels/layout.py to_panels, linear_panels): each
    channels-last group-1 conv's, and each small float32 linear's (LINEAR_PANEL_MAX_MACS);
    returns how many nodes changed. Runs before the chain fusion, whose pointwise convs
    keep their panels.

    Why at pack time: the CPU GEMM otherwise repacked the weights on every call,
    reading them in strided rows the hardware prefetcher cannot follow. Read as
    panels, front to back with a software prefetch one slab ahead, MobileNetV2's and
    ResNet-18's 7x7 layers ran 25-32% faster with their weights cold
    (docs/cpu-kernels.md). A small linear saves BLAS's call and its separate epilogue
    pass: ViT's linears went from half its run time to a third."""
    changed = 0
    for node in g.nodes:
        if node.attrs.get("panel"):
            continue
        if node.op == "conv" and L.is_nhwc(node.attrs):
            _conv_panels(g, node)
        elif _small_linear(g, node):
            w = node.input("w")
            n = int(g.consts[w].shape[0])
            name = w + ".panels"
            if name not in g.consts:
                g.set_const(name, L.linear_panels(g.consts[w]), g.wtype(w))
            node.set_input("w", name)
            node.attrs = {**node.attrs, "panel": L.PANEL, "out_features": n}
        else:
            continue
        changed += 1
    if changed:
        g.remove_dead()
    return changed


def rows16_fit(g: Graph, node: Node) -> bool:
    """Whether a linear's constant int4 or int8 weights can be interleaved by 16 rows:
    N a multiple of 16 (and K of 32 for int8, whose blocks are not padded)."""
    w = node.input("w")
    if w not in g.consts or g.wtype(w) not in ("i4", "i8"):
        return False
    n, k = g.consts[w].shape[:2]
    return n % L.Q4_INTERLEAVE == 0 and (g.wtype(w) == "i4" or k % 32 == 0)


def interleave_rows(g: Graph) -> int:
    """Store the int4 and int8 weights of each linear with int8 activations (``xq``)
    that ``rows16_fit`` interleaved by 16 output rows (kernels/layout.py q4_interleave,
    q8_interleave; attribute ``interleave``), and point an ``embed`` reading the same
    int8 table (a tied output projection) at the interleaved copy; returns how many
    linears changed.

    Why: with each output row in a vector lane of its own, the integer dot products of
    16 rows take one instruction per 4 weights and their float part one multiply-add
    per block for the 16 rows (kernels/cpu/q4x16.py, q8x16.py). SmolLM2-135M's int4
    linears, 2 threads on a 2-core Zen 4, 8 rows of x: 3072x576 159 -> 57 us, 576x1536
    99 -> 44, 576x576 55 -> 23; one row 34 -> 13, 18 -> 10, 11 -> 7 (against qdot.py's
    GEMV on canonical weights); its int8 output projection (49152x576), 8 rows: 2.69 ->
    0.96 ms (against gemv.py's, weights widened to float). The new constants keep their
    shapes and bytes, reordered, under new names, so a graph built from the same
    weights gets the same ones; int8 scales are per row and stay."""
    changed, replaced, tables = 0, set(), {}
    for node in g.nodes:
        if node.op != "linear" or not node.attrs.get("xq") or node.attrs.get("interleave"):
            continue
        if not rows16_fit(g, node):
            continue
        w, s = node.input("w"), node.input("scale")
        wi = w + ".x16"
        if g.wtype(w) == "i4":
            si = s + ".x16"
            if wi not in g.consts:
                packed, scale = L.q4_interleave(g.consts[w], g.consts[s])
                g.set_const(wi, packed, "i4")
                g.set_const(si, scale, g.wtype(s))
            node.set_input("scale", si)
            replaced.add(s)
        else:
            if wi not in g.consts:
                g.set_const(wi, L.q8_interleave(g.consts[w]), "i8")
            tables[w] = wi
        node.set_input("w", wi)
        node.attrs = {**node.attrs, "interleave": L.Q4_INTERLEAVE}
        replaced.add(w)
        changed += 1
    for node in g.nodes:  # a tied table: the embed reads the interleaved copy
        if node.op == "embed" and node.input("w") in tables:
            node.set_input("w", tables[node.input("w")])
            node.attrs = {**node.attrs, "interleave": L.Q4_INTERLEAVE}
    # the canonical copies nothing reads now go (not remove_dead: a decoder graph's
    # KV-cache stores are nobody's inputs)
    for old in replaced - {i for n in g.nodes for i in n.inputs}:
        del g.consts[old]
        g.wtypes.pop(old, None)
    return changed


def _conv_panels(g: Graph, node: Node) -> None:
    w = node.input("w")
    if L.canonical_weights(node.attrs):  # int4: decoded into panels by the kernels
        co = int(node.attrs["wshape"][0])
    else:
        hwio = g.consts[w]
        co = int(hwio.shape[3])
        name = w + ".panels"
        if name not in g.consts:
            g.set_const(name, L.to_panels(hwio), g.wtype(w))
        node.set_input("w", name)
    node.attrs = {**node.attrs, "panel": L.PANEL, "out_channels": co}


def _small_linear(g: Graph, node: Node) -> bool:
    """A linear with constant [N, K] weights stored a weight an element, scaled per
    output channel or not at all (float32, fp16, bf16, int8: the kernels widen the
    panels as they are), float activations and at most LINEAR_PANEL_MAX_MACS
    multiply-adds a run, or float32 of at most LINEAR_PANEL_F32_ROWS rows."""
    if node.op != "linear" or node.attrs.get("xq") or L.canonical_weights(node.attrs):
        return False
    w = node.input("w")
    if w not in g.consts or g.consts[w].ndim != 2:
        return False
    row = wtypes.get(g.wtype(w))
    if row.per_element != 1 or row.scale == "group" or row.decoders.get("cpu") == "own":
        return False
    rows = int(np.prod(g.shapes[node.inputs[0]][:-1], dtype=np.int64))
    if row.name == "f32" and rows <= LINEAR_PANEL_F32_ROWS:
        return True
    return rows * g.consts[w].size <= LINEAR_PANEL_MAX_MACS


def _pixel(shape, nhwc: bool) -> bool:
    """A 4-D tensor of one pixel a channel ([N, C, 1, 1], or [N, 1, 1, C] channels-last),
    whose two layouts are the same bytes: converted by a reshape, no copy."""
    return len(shape) == 4 and (shape[1:3] if nhwc else shape[2:]) == (1, 1)


def _nhwc4(shape) -> tuple[int, ...]:
    return tuple(((1,) * (4 - len(shape)) + tuple(shape))[p] for p in L.TO_NHWC)


def _elementwise_goes_last(g: Graph, node: Node, acts: list[str], last: set[str]) -> bool:
    """An elementwise node runs channels-last when its run-time inputs already are (or
    are one pixel a channel: free to convert) and every input broadcasts there as it did
    channels-first: a squeeze-excite gate
    [1, C, 1, 1] times its feature map (the rapidocr text classifier's nine such muls
    had each cost two transposes), a per-channel constant."""
    out = g.shapes[node.outputs[0]]
    if len(out) != 4 or not acts or not any(a in last for a in acts):
        return False
    if not all(a in last or _pixel(g.shapes[a], False) for a in acts):
        return False
    shapes = [g.shapes[a] if a in last else _nhwc4(g.shapes[a]) for a in acts]
    for c in node.inputs:
        if c in g.consts:
            if g.consts[c].ndim > 4:
                return False
            shapes.append(_nhwc4(g.consts[c].shape))
    try:
        return tuple(np.broadcast_shapes(*shapes)) == _nhwc4(out)
    except ValueError:
        return False


def _nhwc_const(g: Graph, name: str) -> str:
    """The channels-last copy of a constant operand of an elementwise op (rank 4)."""
    v = g.consts[name]
    if v.size == 1:
        return name
    hw = name + ".nhwc"
    if hw not in g.consts:
        v4 = v.reshape((1,) * (4 - v.ndim) + v.shape)
        g.set_const(hw, np.ascontiguousarray(v4.transpose(L.TO_NHWC)), g.wtype(name))
    return hw


def _fresh(g: Graph, name: str) -> str:
    while name in g.shapes or name in g.consts:
        name += "_"
    return name
