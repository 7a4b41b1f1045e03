"""Fuse pointwise -> depthwise -> pointwise conv chains into one ``mbconv`` node
(kernels/mbconv.py), which the cpu backend runs in bands of output rows.

MobileNet's inverted residual blocks expand a thin tensor 6x with a 1x1 conv, run a
depthwise conv on it and project it back with another 1x1 conv. Run node by node, the
expanded tensor (4.8 MB in MobileNetV2's first block) and the depthwise output go to
memory and are read back; in bands, each band's rows are still in L2 when the next
conv reads them. Only worth it where those tensors outgrow the cache: smaller chains
keep their three nodes (in bands they only add calls).

The int8 chains that act_quant.py leaves (a ``qconv`` expansion, a ``qdwconv`` writing
the projection's u8 codes, the ``qconv`` projection) become one ``qmbconv`` node the
same way, with thresholds of their own (below).

Runs after the layout pass and the weight panels, on channels-last nodes, so only on
cpu-first targets; the chain's pointwise convs keep their panels (and their attrs
``panel`` and ``out_channels``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels import layout as L
from ..kernels import mbconv as M
from ..kernels.ops import Y_QUANT
from ..kernels.registry import wants
from .ir import Graph, Node

# A chain is fused when the tensor it keeps out of memory (the expanded one, or the
# depthwise output without an expand conv) is at least this big. MobileNetV2,
# interleaved with ONNX Runtime: 1.03x of it at 1 MB (its 4 largest chains), 1.00x at
# 256 KB (14: the 28x28 and 14x14 ones too), 1.00x fusing all 17; 7x7 chains (188 KB)
# gain nothing, their intermediates stay in L2 anyway.
FUSE_MIN_BYTES = 256 * 1024
# A band's expanded rows plus its depthwise output rows (256, 512, 768 and 1024 KB
# measured on MobileNetV2: 768 was fastest, 256 slowest by 7%).
BAND_BYTES = 768 * 1024
# int8 chains: fused when the expanded tensor E (float32) is at least QFUSE_MIN_BYTES,
# in even bands of at most QBAND_BYTES of E rows plus D rows (u8). Measured on a 2-core
# Xeon (2 MB L2 a core), expand + depthwise + project whole against in bands, median ms:
#   1 thread:  112x112x96 s2 (E 4.8 MB) 0.72 -> 0.51 in bands of 14 rows (1.5 MB),
#              0.53 in 8, 0.66 in 28 (3 MB); 56x56x144 (1.8 MB) 0.47 -> 0.37 in 2 bands,
#              0.41 in 8 rows; 28x28x192 (0.6 MB, in L2 anyway) 0.13 -> 0.13-0.16;
#   2 threads: 112x112x96 0.52 -> 0.46 (14 rows); 56x56x144 0.30 -> 0.28 in 2 bands but
#              0.42 in bands of 8 rows: each band's three kernel calls launch the pool.
# Since the chain is one parallel region a share of rows per thread (kernels/cpu/qmb.py),
# fusing the small chains too pays at 2 threads: fewer launches, and each thread keeps
# its rows through the block. MobileNetV2 int8x8 (EPYC VM, bundles interleaved in one
# process, medians of 60-run blocks) with the threshold at 1 MB / 512 / 256 / 128 KB
# (3 / 6 / 13 / 16 chains): 2 threads 1.91 / 1.87 / 1.86 / 1.82 ms and, in a slower
# spell, 2.62 / 2.59 / 2.56 / 2.50; 1 thread 3.50 / 3.46 / 3.48 / 3.47. 128 KB takes
# all its chains (the smallest, 7x7x960, is 188 KB).
QFUSE_MIN_BYTES = 128 * 1024
QBAND_BYTES = 1536 * 1024


def _pointwise(node: Node, g: Graph) -> bool:
    if node.op != "conv" or not L.is_nhwc(node.attrs) or node.attrs.get("group", 1) != 1:
        return False
    if L.canonical_weights(node.attrs):
        # int4 weights decode whole into scratch (kernels/decoded.py); a band's slots
        # hold panels, so such convs stay unfused.
        return False
    w = g.consts.get(node.input("w"))
    return (
        w is not None
        and L.window(w.shape, node.attrs) == (1, 1)
        and list(node.attrs["strides"]) == [1, 1]
        and not any(node.attrs["pads"])
    )


def _read_only_as_x(t: str, node: Node, consumers: dict, outputs: set) -> bool:
    """Whether ``node`` alone reads ``t``, once, as its input x (inputs[0]), and ``t`` is
    not a graph output: a tensor a chain may keep out of memory."""
    users = consumers.get(t, [])
    return (t not in outputs and len(users) == 1 and users[0] is node
            and node.inputs[0] == t and node.inputs.count(t) == 1)  # fmt: skip


def _has_residual(node: Node) -> bool:
    return bool(node.input("residual"))


def band_rows(
    e_shape: Sequence[int],
    d_shape: Sequence[int],
    attrs: dict,
    kh: int,
    budget: int | None = None,
    d_itemsize: int = 4,
) -> int:
    """Output rows per band: as many as keep a band's E rows (float32) and D rows
    (``d_itemsize`` bytes an element) within ``budget`` (None: BAND_BYTES)."""
    budget = BAND_BYTES if budget is None else budget
    _, h, w, ce = e_shape
    _, oh, ow, _ = d_shape
    best = 1
    for rows in range(1, oh + 1):
        e_rows = min(h, M.dw_rows_in(rows, attrs, kh))
        if (e_rows * w * 4 + rows * ow * d_itemsize) * ce > budget:
            break
        best = rows
    return best


def fuse_mbconv(g: Graph, backends: Sequence[str]) -> int:
    """Fuse the chains that qualify, in place; returns how many."""
    if not wants(backends, "chains"):
        return 0
    consumers = g.consumers()
    producer = g.producer()
    outputs = set(g.outputs)

    def only_into(t: str, node: Node) -> bool:
        return _read_only_as_x(t, node, consumers, outputs)

    def padded(node: Node, n: int) -> list[str]:
        return (list(node.inputs) + [""] * n)[:n]

    fused: dict[int, Node] = {}  # id of the projection -> the fused node
    gone: set[int] = set()
    for dw in g.nodes:
        if dw.op != "dwconv" or not L.is_nhwc(dw.attrs) or _has_residual(dw):
            continue
        users = consumers.get(dw.outputs[0], [])
        if len(users) != 1 or not _pointwise(users[0], g) or not only_into(dw.outputs[0], users[0]):
            continue
        proj = users[0]
        exp = producer.get(dw.inputs[0])
        if exp is not None and not (
            id(exp) not in gone  # the projection of the chain before
            and _pointwise(exp, g)
            and not _has_residual(exp)
            and only_into(dw.inputs[0], dw)
        ):
            exp = None
        e_shape, d_shape = g.shapes[dw.inputs[0]], g.shapes[dw.outputs[0]]
        kept = e_shape if exp is not None else d_shape  # what stays out of memory
        if int(np.prod(kept)) * 4 < FUSE_MIN_BYTES:
            continue
        kh = g.consts[dw.input("w")].shape[0]
        attrs = {
            "layout": L.NHWC,
            "dw": dict(dw.attrs),
            "project": dict(proj.attrs),
            "band": band_rows(e_shape, d_shape, dw.attrs, kh),
        }
        if exp is not None:
            attrs["expand"] = dict(exp.attrs)
            head = [exp.inputs[0], *padded(exp, 4)[1:]]
        else:
            head = [dw.inputs[0], "", "", ""]
        inputs = head + padded(dw, 4)[1:] + padded(proj, 5)[1:]
        chain = [n for n in (exp, dw, proj) if n is not None]
        fused[id(proj)] = Node(
            "mbconv",
            f"{chain[0].name}..{proj.name}",
            inputs,
            list(proj.outputs),
            attrs,
            [s for n in chain for s in n.sources],
        )
        gone.update(id(n) for n in chain)
        for n in chain[:-1]:
            del g.shapes[n.outputs[0]]
    g.nodes = [fused.get(id(n), n) for n in g.nodes if id(n) not in gone or id(n) in fused]
    return len(fused) + _fuse_int8(g)


def _q_pointwise(node: Node | None) -> bool:
    if node is None or node.op != "qconv":
        return False
    a = node.attrs
    return tuple(a["kernel"]) == (1, 1) and list(a["strides"]) == [1, 1] and not any(a["pads"])


def _fuse_int8(g: Graph) -> int:
    """Fuse qconv -> qdwconv -> qconv chains whose E is QFUSE_MIN_BYTES or more into
    ``qmbconv`` nodes (kernels/mbconv.py), in place; returns how many. The expansion
    writes float32 (act_quant.py keeps a depthwise conv's input float32) and reads only
    into the depthwise conv, which writes the codes only the projection reads."""
    consumers, producer, outputs = g.consumers(), g.producer(), set(g.outputs)

    def only_into(t: str, node: Node) -> bool:
        return _read_only_as_x(t, node, consumers, outputs)

    fused: dict[int, Node] = {}
    gone: set[int] = set()
    for dw in g.nodes:
        if dw.op != "qdwconv":
            continue
        users = consumers.get(dw.outputs[0], [])
        proj = users[0] if len(users) == 1 else None
        exp = producer.get(dw.inputs[0])
        if not (
            _q_pointwise(proj)
            and only_into(dw.outputs[0], proj)
            and _q_pointwise(exp)
            and id(exp) not in gone
            and not exp.input("residual")
            and "y_scale" not in exp.attrs
            and only_into(dw.inputs[0], dw)
        ):
            continue
        e_shape, d_shape = g.shapes[dw.inputs[0]], g.shapes[dw.outputs[0]]
        if int(np.prod(e_shape)) * 4 < QFUSE_MIN_BYTES:
            continue
        most = band_rows(e_shape, d_shape, dw.attrs, 3, QBAND_BYTES, 1)
        n_bands = -(-d_shape[1] // most)
        project = dict(proj.attrs)
        attrs = {
            "layout": L.NHWC,
            "expand": dict(exp.attrs),
            "dw": dict(dw.attrs),
            "project": project,
            "band": -(-d_shape[1] // n_bands),  # even bands: the same count, less cache
        }
        attrs.update({k: project.pop(k) for k in Y_QUANT if k in project})
        e, d, p = exp.input, dw.input, proj.input
        fused[id(proj)] = Node(
            "qmbconv",
            f"{exp.name}..{proj.name}",
            [e("x"), e("w"), e("bias"), e("scale"), e("zw"), d("w"), d("bias"), d("scale"),
             p("w"), p("bias"), p("scale"), p("zw"), p("residual")],  # fmt: skip
            list(proj.outputs),
            attrs,
            [s for n in (exp, dw, proj) for s in n.sources],
        )
        gone.update((id(exp), id(dw), id(proj)))
        for n in (exp, dw):
            del g.shapes[n.outputs[0]]
            g.dtypes.pop(n.outputs[0], None)
    g.nodes = [fused.get(id(n), n) for n in g.nodes if id(n) not in gone or id(n) in fused]
    return len(fused)
