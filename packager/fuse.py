"""Graph rewrites done once at pack time so the device does less work.

- BatchNormalization (``channel_affine``) folded into the preceding conv / linear.
- ``linear`` or conv followed by an add of a constant vector: the vector becomes its
  bias (and the add's activation its epilogue).
- ``x * hard_sigmoid(x)`` (MobileNetV3's h-swish), and ``x * clip(x + 3, 0, 6) / 6``,
  become one ``hard_swish``; ``x * sigmoid(x)`` one ``silu``.
- linear -> linear with nothing between: one linear of the weights' product (when no
  larger); linears reading one tensor (Q/K/V, gate/up): one linear, its output sliced.
- conv + residual add: the add becomes the conv's epilogue (ResNet, MobileNetV2).
- an exporter's attention, MatMul -> (scale) -> (mask add) -> Softmax -> MatMul, with
  scalar muls on either operand of the first: one ``sdpa`` (ViT, BERT, Whisper).
- an activation after conv / linear / binary / affine / matmul: fused as the epilogue.

Each rewrite needs the intermediate tensor to have exactly one consumer and not be a
graph output, so nothing observable disappears.
"""

from __future__ import annotations

import numpy as np

from ..kernels.ops import OpError, output_shape
from .ir import Graph, Node

CONV_OPS = ("conv", "dwconv")
EPILOGUE_OPS = ("conv", "dwconv", "linear", "binary", "channel_affine", "matmul")


def _single_use(g: Graph, name: str, consumers: dict[str, list[Node]]) -> bool:
    return name not in g.outputs and len(consumers.get(name, [])) == 1


def _merge(g: Graph, producer: Node, consumer: Node, at_consumer: bool = False) -> None:
    """``producer`` takes over ``consumer``'s output; ``consumer`` disappears.

    With ``at_consumer`` the merged node moves to the consumer's position, which is
    needed when the consumer reads something computed after the producer.
    """
    g.shapes.pop(producer.outputs[0], None)
    producer.outputs = list(consumer.outputs)
    producer.sources += [s for s in consumer.sources if s not in producer.sources]
    i = g.nodes.index(consumer)
    if at_consumer:
        g.nodes.remove(producer)
        g.nodes[g.nodes.index(consumer)] = producer
    else:
        del g.nodes[i]


def _const_name(g: Graph, base: str) -> str:
    name, k = base, 0
    while name in g.consts or name in g.shapes:
        k += 1
        name = f"{base}.{k}"
    return name


def fold_batchnorm(g: Graph) -> int:
    n_folded = 0
    changed = True
    while changed:
        changed = False
        prod, cons = g.producer(), g.consumers()
        for bn in list(g.nodes):
            if bn.op != "channel_affine" or bn.attrs.get("act", "none") != "none":
                continue
            p = prod.get(bn.inputs[0])
            if p is None or not _single_use(g, bn.inputs[0], cons):
                continue
            if p.attrs.get("act", "none") != "none":
                continue
            if p.op in CONV_OPS and not p.input("residual"):
                axis_shape = (-1, 1, 1, 1)
            elif p.op == "linear" and len(g.shapes[bn.inputs[0]]) == 2:
                axis_shape = (-1, 1)
            else:
                continue
            scale, shift = g.consts[bn.input("scale")], g.consts[bn.input("shift")]
            w = g.consts[p.input("w")]
            b = g.consts[p.input("bias")] if p.input("bias") else 0.0
            wn = _const_name(g, p.name + ".weight")
            bname = _const_name(g, p.name + ".bias")
            g.consts[wn] = (w * scale.reshape(axis_shape)).astype(np.float32)
            g.consts[bname] = (np.asarray(b) * scale + shift).astype(np.float32)
            p.set_input("w", wn)
            p.set_input("bias", bname)
            _merge(g, p, bn)
            n_folded += 1
            changed = True
            break
    return n_folded


def _as_bias(g: Graph, p: Node, c: np.ndarray) -> np.ndarray | None:
    """``c`` as a bias vector of ``p`` (a linear's last axis; a conv's channel axis:
    (1, C, 1, 1) or (C, 1, 1)), or None when an add of it is not a bias add."""
    nout = g.consts[p.input("w")].shape[0] if p.op == "linear" else g.shapes[p.outputs[0]][1]
    if c.size != nout:
        return None
    if p.op == "linear":
        return c.reshape(nout) if c.shape[-1] == nout else None
    full = (1,) * (4 - c.ndim) + tuple(c.shape) if c.ndim <= 4 else None
    return c.reshape(nout) if full == (1, nout, 1, 1) else None


def fuse_linear_bias(g: Graph) -> int:
    """An add of a constant vector after a linear or a conv becomes its bias, and the
    add's activation its epilogue (PaddleOCR's squeeze-excite convs add their biases as
    separate Adds: 18 binary nodes of the text classifier's 221 steps)."""
    n = 0
    prod, cons = g.producer(), g.consumers()
    for add in list(g.nodes):
        if add.op != "binary" or add.attrs["kind"] != "add":
            continue
        consts = [i for i in add.inputs if i in g.consts]
        acts = [i for i in add.inputs if i not in g.consts]
        if len(consts) != 1 or len(acts) != 1:
            continue
        p = prod.get(acts[0])
        if p is None or p.op not in ("linear", *CONV_OPS) or p.attrs["act"] != "none":
            continue
        if (p.op in CONV_OPS and p.input("residual")) or not _single_use(g, acts[0], cons):
            continue
        if g.shapes[acts[0]] != g.shapes[add.outputs[0]]:
            continue
        c = _as_bias(g, p, g.consts[consts[0]])
        if c is None:
            continue
        old = g.consts[p.input("bias")] if p.input("bias") else 0.0
        bname = _const_name(g, p.name + ".bias")
        g.consts[bname] = (np.asarray(old) + c).astype(np.float32)
        p.set_input("bias", bname)
        p.attrs["act"] = add.attrs["act"]
        p.attrs["act_args"] = list(add.attrs["act_args"])
        _merge(g, p, add)
        prod, cons = g.producer(), g.consumers()
        n += 1
    return n


def _clipped_add3(g: Graph, prod, cons, name: str) -> list[Node] | None:
    """The nodes making ``name`` = clip(a + b, 0, 6), single-use: an add with the clip
    as its epilogue, or an add then a clip; None if it is not that."""

    def clip06(n: Node) -> bool:
        return n.attrs.get("act") == "clip" and np.allclose(n.attrs["act_args"], [0.0, 6.0])

    n = prod.get(name)
    if n is None or not _single_use(g, name, cons):
        return None
    if n.op == "binary" and n.attrs["kind"] == "add" and clip06(n):
        return [n]
    if n.op != "unary" or not clip06(n):
        return None
    add = prod.get(n.inputs[0])
    if add is None or add.op != "binary" or add.attrs["kind"] != "add":
        return None
    if add.attrs["act"] != "none" or not _single_use(g, n.inputs[0], cons):
        return None
    return [add, n]


def fuse_decomposed_hard_swish(g: Graph) -> int:
    """x * clip(x + 3, 0, 6) / 6 (hard-swish as exporters that lack the op write it:
    paddle2onnx, older torch) becomes one ``hard_swish`` unary, which the activation
    rewrite then folds into the conv before it: 54 binary nodes of the rapidocr text
    classifier's 221 steps."""
    n = 0
    prod, cons = g.producer(), g.consumers()

    def scalar(name: str, value: float) -> bool:
        return (
            name in g.consts
            and g.consts[name].size == 1
            and np.isclose(float(g.consts[name].reshape(-1)[0]), value)
        )

    for div in list(g.nodes):
        if div.op != "binary" or div.attrs["act"] != "none" or len(div.inputs) != 2:
            continue
        m_name, k = div.inputs
        if not ((div.attrs["kind"] == "div" and scalar(k, 6.0)) or
                (div.attrs["kind"] == "mul" and scalar(k, 1 / 6))):  # fmt: skip
            continue
        mul = prod.get(m_name)
        if mul is None or mul.op != "binary" or mul.attrs["kind"] != "mul":
            continue
        if mul.attrs["act"] != "none" or not _single_use(g, m_name, cons):
            continue
        for t_name, x in (mul.inputs, mul.inputs[::-1]):
            chain = _clipped_add3(g, prod, cons, t_name)
            if chain is None or chain[0].inputs[0] != x or not scalar(chain[0].inputs[1], 3.0):
                continue
            if g.shapes.get(x) != g.shapes[div.outputs[0]]:
                continue
            gone = [*chain, mul]
            hs = Node("unary", div.name, [x], list(div.outputs),
                      {"act": "hard_swish", "act_args": [0.0, 0.0]},
                      [s for n in (*gone, div) for s in n.sources])  # fmt: skip
            g.nodes[g.nodes.index(div)] = hs
            for node in gone:
                g.nodes.remove(node)
                g.shapes.pop(node.outputs[0], None)
            prod, cons = g.producer(), g.consumers()
            n += 1
            break
    return n


# x * gate(x) -> one activation: (the gate's activation, its act_args or None for any)
# -> the fused activation. MobileNetV3's h-swish; SiLU as exporters write it (YOLOv5-v11,
# EfficientNet), whose 57 Sigmoid nodes took half of YOLOv8n's time at 640 x 640 (112
# of 222 ms) beside their multiplies.
SELF_GATED = {("hard_sigmoid", (1 / 6, 0.5)): "hard_swish", ("sigmoid", None): "silu"}


def fuse_self_gated(g: Graph) -> int:
    """x * gate(x) becomes one unary of SELF_GATED's activation, which the activation
    rewrite then folds into the conv before it."""
    n = 0
    prod, cons = g.producer(), g.consumers()
    for mul in list(g.nodes):
        if mul.op != "binary" or mul.attrs["kind"] != "mul" or mul.attrs["act"] != "none":
            continue
        for gate_name, x in (mul.inputs, mul.inputs[::-1]):
            gate = prod.get(gate_name)
            if gate is None or gate.op != "unary" or gate.inputs[0] != x:
                continue
            fused = next((f for (act, args), f in SELF_GATED.items() if gate.attrs["act"] == act
                          and (args is None or np.allclose(gate.attrs["act_args"], args))),
                         None)  # fmt: skip
            if fused is None or not _single_use(g, gate_name, cons):
                continue
            if g.shapes.get(x) != g.shapes[mul.outputs[0]]:
                continue
            gate.attrs = {"act": fused, "act_args": [0.0, 0.0]}
            _merge(g, gate, mul)
            prod, cons = g.producer(), g.consumers()
            n += 1
            break
    return n


def _scalar(g: Graph, name: str, value: float) -> bool:
    """``name`` is a constant holding one value close to ``value`` (float32 rounding)."""
    v = g.consts.get(name)
    return v is not None and v.size == 1 and abs(float(v.reshape(-1)[0]) - value) < 1e-5


def _other(n: Node, name: str) -> str | None:
    """The other input of a two-input node that reads ``name``."""
    a, b = n.inputs[:2]
    return b if a == name else a if b == name else None


def fuse_gelu(g: Graph) -> int:
    """GELU into one activation (the act table's float32 "gelu", which the activation
    rewrite folds into the linear before it): the math op's exact gelu (ONNX's Gelu),
    and GELU as torch.onnx writes it before opset 20, x * 0.5 * (1 + erf(x / sqrt 2))
    in either grouping of the products (Div by sqrt 2 or Mul by its inverse)."""
    n = 0
    for m in g.nodes:
        if m.op == "math" and m.attrs["fn"] == "gelu":
            m.op, m.attrs = "unary", {"act": "gelu", "act_args": [0.0, 0.0]}
            n += 1
    prod, cons = g.producer(), g.consumers()

    def binary(node: Node | None, kind: str) -> bool:
        return (node is not None and node.op == "binary" and node.attrs["kind"] == kind
                and node.attrs["act"] == "none")  # fmt: skip

    def only(name: str) -> Node | None:
        users = cons.get(name, [])
        return users[0] if len(users) == 1 and name not in g.outputs else None

    for erf in list(g.nodes):
        if erf.op != "math" or erf.attrs["fn"] != "erf":
            continue
        scaled = prod.get(erf.inputs[0])
        if not (binary(scaled, "div") and _scalar(g, scaled.inputs[1], 2**0.5)) and not (
            binary(scaled, "mul") and _scalar(g, scaled.inputs[1], 0.5**0.5)
        ):
            continue
        x = scaled.inputs[0]
        add = only(erf.outputs[0])
        if not binary(add, "add") or not _scalar(g, _other(add, erf.outputs[0]) or "", 1.0):
            continue
        mul = only(add.outputs[0])
        if not binary(mul, "mul"):
            continue
        y = _other(mul, add.outputs[0])
        half = prod.get(y)
        if y == x:  # (x * (1 + erf)) * 0.5
            last = only(mul.outputs[0])
            if not binary(last, "mul") or not _scalar(g, _other(last, mul.outputs[0]) or "", 0.5):
                continue
            drop = [erf, add, mul]
        elif binary(half, "mul") and x in half.inputs and _scalar(g, _other(half, x), 0.5):
            last, drop = mul, [erf, add]  # (x * 0.5) * (1 + erf)
            if _single_use(g, half.outputs[0], cons):  # else x * 0.5 is read elsewhere too
                drop.append(half)
        else:
            continue
        if g.shapes.get(x) != g.shapes[last.outputs[0]]:
            continue
        if not _single_use(g, scaled.outputs[0], cons):
            continue
        gelu = Node("unary", last.name, [x], list(last.outputs),
                    {"act": "gelu", "act_args": [0.0, 0.0]},
                    sorted({s for k in (scaled, *drop, last) for s in k.sources}))  # fmt: skip
        g.nodes[g.nodes.index(last)] = gelu
        for k in {id(k): k for k in (scaled, *drop)}.values():
            if k is not last and k in g.nodes:
                g.nodes.remove(k)
        prod, cons = g.producer(), g.consumers()
        n += 1
    return n


def _plain_linear(g: Graph, n: Node) -> bool:
    """A float32 linear with constant weights and no scale or int8 activations: one
    whose weights can be combined with another's."""
    return (
        n.op == "linear" and n.input("w") in g.consts and not n.input("scale")
        and g.consts[n.input("w")].dtype == np.float32 and g.consts[n.input("w")].ndim == 2
        and not n.attrs.get("xq") and "wshape" not in n.attrs
    )  # fmt: skip


def _bias_of(g: Graph, n: Node) -> np.ndarray:
    rows = g.consts[n.input("w")].shape[0]
    b = n.input("bias")
    return g.consts[b].astype(np.float32) if b else np.zeros(rows, np.float32)


def merge_consecutive_linears(g: Graph) -> int:
    """linear -> linear with nothing between (no activation, the first's output read
    only by the second) becomes one linear of the product of the weights,
    W2 (W1 x + b1) + b2, when that product is no larger than the two: a low-rank
    factorisation is left as it is (its two GEMMs do less work)."""
    n = 0
    changed = True
    while changed:
        changed = False
        prod, cons = g.producer(), g.consumers()
        for second in list(g.nodes):
            if not _plain_linear(g, second):
                continue
            first = prod.get(second.inputs[0])
            if first is None or not _plain_linear(g, first) or first.attrs["act"] != "none":
                continue
            if not _single_use(g, first.outputs[0], cons):
                continue
            w1, w2 = g.consts[first.input("w")], g.consts[second.input("w")]
            (m, k), nn = w1.shape, w2.shape[0]
            if nn * k > m * k + nn * m:
                continue
            w = (w2.astype(np.float64) @ w1.astype(np.float64)).astype(np.float32)
            b = w2.astype(np.float64) @ _bias_of(g, first) + _bias_of(g, second)
            wn, bn = (
                _const_name(g, second.name + ".merged_w"),
                _const_name(g, second.name + ".merged_b"),
            )
            g.consts[wn], g.consts[bn] = w, b.astype(np.float32)
            second.set_input("w", wn)
            second.set_input("bias", bn)
            second.inputs[0] = first.inputs[0]
            second.sources = [*first.sources, *second.sources]
            g.shapes.pop(first.outputs[0], None)
            g.nodes.remove(first)
            n += 1
            changed = True
            break
    return n


# Rows up to which sibling linears merge. The slices that split the merged output copy
# it, which pays while the GEMMs are short: 1 thread, a ViT's 17 tokens ran 11% faster
# merged (0.245 -> 0.217 ms), MiniLM's 128 tokens 3% slower (66.4 -> 68.7 ms).
SIBLING_MAX_ROWS = 32


def merge_sibling_linears(g: Graph) -> int:
    """Linears that read the same tensor (attention's Q, K and V projections, an MLP's
    gate and up) become one linear of their weights stacked, its output sliced back into
    theirs: one GEMM with more columns in place of several, for inputs of up to
    SIBLING_MAX_ROWS rows. Returns how many linears were folded into another."""
    groups: dict[tuple, list[Node]] = {}
    for node in g.nodes:
        x = node.inputs[0] if _plain_linear(g, node) else ""
        if x and x not in g.consts and int(np.prod(g.shapes[x][:-1])) <= SIBLING_MAX_ROWS:
            key = (node.inputs[0], node.attrs["act"], tuple(node.attrs.get("act_args", ())))
            groups.setdefault(key, []).append(node)
    n = 0
    for (x, _, _), sibs in groups.items():
        if len(sibs) < 2 or any(s.outputs[0] in g.outputs for s in sibs):
            continue
        first = sibs[0]
        ws = [g.consts[s.input("w")] for s in sibs]
        if len({w.shape[1] for w in ws}) != 1:
            continue
        name = _const_name(g, first.name + ".siblings")
        wn, bn = _const_name(g, name + ".w"), _const_name(g, name + ".b")
        g.consts[wn] = np.ascontiguousarray(np.concatenate(ws, axis=0))
        g.consts[bn] = np.concatenate([_bias_of(g, s) for s in sibs]).astype(np.float32)
        out_shape = (*g.shapes[x][:-1], int(sum(w.shape[0] for w in ws)))
        g.shapes[name] = out_shape
        merged = Node("linear", name, [x, wn, bn], [name], dict(first.attrs),
                      [src for s in sibs for src in s.sources])  # fmt: skip
        slices, start = [], 0
        for s, w in zip(sibs, ws):
            rank = len(out_shape)
            attrs = {"starts": [0] * (rank - 1) + [start], "steps": [1] * rank,
                     "sizes": [*out_shape[:-1], int(w.shape[0])]}  # fmt: skip
            slices.append(Node("slice", s.name, [name], list(s.outputs), attrs, list(s.sources)))
            start += int(w.shape[0])
        at = g.nodes.index(first)
        for s in sibs:
            g.nodes.remove(s)
        g.nodes[at:at] = [merged, *slices]
        n += len(sibs) - 1
    return n


def _scalar_value(g: Graph, n: Node | None, x: str) -> float | None:
    """The factor of ``n`` = binary mul (or div) of ``x`` by a one-value float32
    constant, no activation; None otherwise."""
    if n is None or n.op != "binary" or n.attrs.get("act", "none") != "none":
        return None
    kind, other = n.attrs["kind"], _other(n, x)
    c = g.consts.get(other or "")
    if c is None or c.size != 1 or c.dtype != np.float32 or other == x:
        return None
    if kind == "mul":
        return float(c.reshape(-1)[0])
    if kind == "div" and n.inputs[0] == x and float(c.reshape(-1)[0]) != 0.0:
        return 1.0 / float(c.reshape(-1)[0])
    return None


def _nan_guard(g: Graph, p: str, cons: dict[str, list[Node]]) -> tuple[str, list[Node]]:
    """(the probabilities the second MatMul reads, the guard's nodes): torch's export
    of masked attention follows the Softmax with Where(IsNaN(p), 0, p) (IsNaN as
    Not(Equal(p, p))), or Where(Equal(p, p), p, 0); else (p, [])."""
    users = list({id(u): u for u in cons.get(p, [])}.values())  # Equal reads p twice
    if len(users) != 2 or p in g.outputs:
        return p, []
    eq = next((u for u in users if u.op == "compare" and u.attrs.get("kind") == "equal"
               and u.inputs[:2] == [p, p]), None)  # fmt: skip
    w = next((u for u in users if u.op == "where"), None)
    if eq is None or w is None or g.shapes.get(w.outputs[0]) != g.shapes.get(p):
        return p, []
    after = cons.get(eq.outputs[0], [])
    if len(after) != 1 or eq.outputs[0] in g.outputs:
        return p, []
    nt = after[0]
    if (nt.op == "logic" and nt.attrs.get("kind") == "not" and len(cons.get(nt.outputs[0], [])) == 1
            and nt.outputs[0] not in g.outputs and w.inputs == [nt.outputs[0], w.inputs[1], p]
            and _scalar(g, w.inputs[1], 0.0)):  # fmt: skip
        return w.outputs[0], [eq, nt, w]
    if nt is w and w.inputs == [eq.outputs[0], p, w.inputs[2]] and _scalar(g, w.inputs[2], 0.0):
        return w.outputs[0], [eq, w]
    return p, []


def fuse_attention(g: Graph) -> int:
    """softmax(scale * q @ kt + mask) @ v as exporters write it (a MatMul, a Mul or Div
    by a constant, an Add of the mask, a Softmax over the last axis, a MatMul; torch's
    SDPA export scales q and k^T each by a root of the scale instead) into one ``sdpa``
    node: six steps of a ViT layer's attention become one call whose rows of scores
    stay in cache. Ranks 3 and 4, q, k^T and v with the same leading axes (no
    broadcast between them), every intermediate read only by the next."""
    n = 0
    prod, cons = g.producer(), g.consumers()

    def only(name: str) -> Node | None:
        users = cons.get(name, [])
        return users[0] if _single_use(g, name, cons) and len(users) == 1 else None

    def shape(name: str):
        return g.consts[name].shape if name in g.consts else g.shapes.get(name)

    def plain(node: Node | None, op: str) -> bool:
        return node is not None and node.op == op and node.attrs.get("act", "none") == "none"

    for sm in list(g.nodes):
        if sm.op != "softmax" or sm.attrs.get("log"):
            continue
        x = sm.inputs[0]
        rank = len(g.shapes.get(x, ()))
        if rank not in (3, 4) or sm.attrs["axis"] % rank != rank - 1:
            continue
        probs, guard = _nan_guard(g, sm.outputs[0], cons)
        mm2 = only(probs)
        if not plain(mm2, "matmul") or mm2.inputs[0] != probs:
            continue
        drop, scale, mask, s = [sm, *guard], 1.0, None, x
        add = prod.get(s)
        if plain(add, "binary") and add.attrs["kind"] == "add" and only(s) is sm:
            for cand in add.inputs:
                other = _other(add, cand)
                p = prod.get(cand)
                if other and other != cand and p is not None and (
                        p.op == "matmul" or _scalar_value(g, p, p.inputs[0]) is not None):
                    mask, s = other, cand
                    drop.append(add)
                    break
        if mask is not None and (g.dtype(mask) != "f32" if mask not in g.consts
                                 else g.consts[mask].dtype != np.float32):
            continue
        p = prod.get(s)
        if p is not None and p.op == "binary" and only(s) is drop[-1]:
            f = _scalar_value(g, p, p.inputs[0])
            if f is not None:
                scale, s = scale * f, p.inputs[0]
                drop.append(p)
        mm1 = prod.get(s)
        if not plain(mm1, "matmul") or only(s) is not drop[-1]:
            continue
        drop.append(mm1)
        q, kt = mm1.inputs[:2]
        for side in (0, 1):  # a scalar mul on q or on k^T, read by nothing else
            t = (q, kt)[side]
            pm = prod.get(t)
            f = _scalar_value(g, pm, pm.inputs[0]) if pm is not None else None
            if f is not None and only(t) is mm1 and pm.inputs[0] != (kt, q)[side]:
                scale *= f
                drop.append(pm)
                q, kt = (pm.inputs[0], kt) if side == 0 else (q, pm.inputs[0])
        v = mm2.inputs[1]
        ins = [q, kt, v] + ([mask] if mask else [])
        shapes = [shape(t) for t in ins]
        if any(sh is None for sh in shapes) or any(g.dtype(t) != "f32" for t in ins[:3]):
            continue
        if not (len(shapes[0]) == len(shapes[1]) == len(shapes[2]) == rank):
            continue
        attrs = {"scale": scale, "k_t": 1, **({"nan_zero": 1} if guard else {})}
        try:
            out = output_shape("sdpa", [tuple(sh) for sh in shapes], attrs)
        except OpError:
            continue
        if tuple(out) != tuple(g.shapes[mm2.outputs[0]]):
            continue
        fused = Node("sdpa", mm2.name, ins, list(mm2.outputs), attrs,
                     sorted({src for k in (*drop, mm2) for src in k.sources}))  # fmt: skip
        g.nodes[g.nodes.index(mm2)] = fused
        for k in drop:
            g.shapes.pop(k.outputs[0], None)
            g.nodes.remove(k)
        prod, cons = g.producer(), g.consumers()
        n += 1
    return n


def fuse_residual(g: Graph) -> int:
    n = 0
    prod, cons = g.producer(), g.consumers()
    for add in list(g.nodes):
        if add.op != "binary" or add.attrs["kind"] != "add" or add.attrs["act"] != "none":
            continue
        if any(i in g.consts for i in add.inputs):
            continue
        out_shape = g.shapes[add.outputs[0]]
        for conv_out, other in (add.inputs, add.inputs[::-1]):
            p = prod.get(conv_out)
            if p is None or p.op not in CONV_OPS or p.attrs["act"] != "none":
                continue
            if p.input("residual"):
                continue
            if g.shapes[conv_out] != out_shape or g.shapes.get(other) != out_shape:
                continue
            if other == conv_out or not _single_use(g, conv_out, cons):
                continue
            p.set_input("residual", other)
            _merge(g, p, add, at_consumer=True)  # `other` may be computed after the conv
            prod, cons = g.producer(), g.consumers()
            n += 1
            break
    return n


def fuse_activations(g: Graph) -> int:
    n = 0
    prod, cons = g.producer(), g.consumers()
    for act in list(g.nodes):
        if act.op != "unary":
            continue
        p = prod.get(act.inputs[0])
        if p is None or p.op not in EPILOGUE_OPS or p.attrs.get("act", "none") != "none":
            continue
        if not _single_use(g, act.inputs[0], cons):
            continue
        p.attrs["act"] = act.attrs["act"]
        p.attrs["act_args"] = list(act.attrs["act_args"])
        _merge(g, p, act)
        prod, cons = g.producer(), g.consumers()
        n += 1
    return n


def optimise(g: Graph) -> dict[str, int]:
    """Run every rewrite; returns how often each fired (printed at pack time)."""
    stats = {
        "batchnorm_folded": fold_batchnorm(g),
        "linear_bias_fused": fuse_linear_bias(g),
        "linears_merged": merge_consecutive_linears(g) + merge_sibling_linears(g),
        "hard_swish_fused": fuse_decomposed_hard_swish(g),
        "self_gated_fused": fuse_self_gated(g),
        "gelu_fused": fuse_gelu(g),
        "attention_fused": fuse_attention(g),
        "residual_fused": fuse_residual(g),
        "activation_fused": fuse_activations(g),
    }
    g.remove_dead()
    return stats
