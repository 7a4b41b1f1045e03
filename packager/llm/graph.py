"""The decoder as an IR graph over T rows (tokens): one graph per shape the runtime runs,
prefill (a chunk of one prompt, T = chunk) and decode (T = one row per sequence slot),
over the same constants and the same KV cache (the graphs' state).

Per layer: norm -> one q/k/v projection (the three stored as one matrix, decided here)
-> (Qwen3) an RMSNorm of each q and k head -> rope on the q and k heads -> attention
over the cache -> output projection -> residual add -> norm -> one gate/up projection
-> glu -> down projection -> residual add. Then the final norm and the output
projection (the embedding table itself when tied).

Inputs: ``ids``, ``pos``, ``slot`` (int32 [T]; a row with slot -1 is idle). Output:
``logits`` [T, vocab]; a prompt chunk's graph gives its last row's only, [1, vocab].
"""

from __future__ import annotations

import numpy as np

from ...runtime.bundle_format import TENSOR_DTYPES
from ..ir import Graph, Node, PackError
from .arch import DecoderSpec

NONE = {"act": "none", "act_args": [0.0, 0.0]}
EMBED = "model.embed_tokens.weight"
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"


def kv_names(layer: int) -> tuple[str, str]:
    return f"k_cache.{layer}", f"v_cache.{layer}"


def fused_weights(spec: DecoderSpec, w) -> dict[str, np.ndarray]:
    """The graph's constants, float32, from ``w(name)`` (an HF tensor as float32, or
    None when absent): q/k/v and gate/up concatenated along the output axis."""
    out = {EMBED: w(EMBED)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = w(p + "input_layernorm.weight")
        out[a + "qkv_proj.weight"] = np.concatenate([w(a + f"{x}_proj.weight") for x in "qkv"])
        if spec.qkv_bias:
            out[a + "qkv_proj.bias"] = np.concatenate([w(a + f"{x}_proj.bias") for x in "qkv"])
        if spec.qk_norm:  # one weight over q's and k's heads: each head's tiled (ops norm)
            out[a + "qk_norm.weight"] = np.concatenate(
                [np.tile(w(a + "q_norm.weight"), spec.heads),
                 np.tile(w(a + "k_norm.weight"), spec.kv_heads)]
            )  # fmt: skip
        out[a + "o_proj.weight"] = w(a + "o_proj.weight")
        if spec.o_bias:
            out[a + "o_proj.bias"] = w(a + "o_proj.bias")
        out[p + "post_attention_layernorm.weight"] = w(p + "post_attention_layernorm.weight")
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = np.concatenate(
            [w(m + "gate_proj.weight"), w(m + "up_proj.weight")]
        )
        out[m + "down_proj.weight"] = w(m + "down_proj.weight")
    out["model.norm.weight"] = w("model.norm.weight")
    if not spec.tied:
        out["lm_head.weight"] = w("lm_head.weight")
    return out


def decoder_graph(
    spec: DecoderSpec,
    consts: dict[str, np.ndarray],
    rows: int,
    ctx: int,
    slots: int,
    kv_dtype: str,
    last_only: bool = False,
) -> Graph:
    """The graph of ``rows`` tokens a run over ``consts`` (fused_weights, plus the RoPE
    tables), with KV caches of ``slots`` sequences of ``ctx`` positions. ``last_only``
    (the prompt chunk): logits of the last row alone, [1, vocab]; the runtime puts a
    chunk's last token there. At 32 rows the output projection of every row had been
    18% of a chunk's time (SmolLM2, int4)."""
    if kv_dtype not in ("f16", "f32"):
        raise PackError(f"--kv {kv_dtype!r}: choose f16 or f32")
    h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
    g = Graph(nodes=[], inputs=["ids", "pos", "slot"], outputs=["logits"], shapes={},
              consts=dict(consts))  # fmt: skip
    for t in g.inputs:
        g.shapes[t] = (rows,)
        g.dtypes[t] = "i32"
    assert np.dtype(TENSOR_DTYPES[kv_dtype])  # a tensor dtype the arena holds

    def node(op: str, name: str, inputs: list[str], shape: tuple, attrs: dict | None = None):
        g.nodes.append(Node(op, name, inputs, [name], dict(attrs or {}), [name]))
        g.shapes[name] = shape
        return name

    def linear(name: str, x: str, w: str, bias: str = "") -> str:
        n = consts[w].shape[0]
        return node("linear", name, [x, w] + ([bias] if bias else []), (rows, n), NONE)

    def norm(name: str, x: str, w: str) -> str:
        attrs = {"kind": "rms", "eps": spec.norm_eps}
        return node("norm", name, [x, w], (rows, spec.hidden), attrs)

    def add(name: str, a: str, b: str) -> str:
        return node("binary", name, [a, b], (rows, spec.hidden), {"kind": "add", **NONE})

    x = node("embed", "embed", ["ids", EMBED], (rows, spec.hidden))
    for i in range(spec.layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        kc, vc = kv_names(i)
        for c in (kc, vc):
            g.shapes[c] = (slots, ctx, hkv, d)
            g.dtypes[c] = kv_dtype
            g.state.append(c)
        n = norm(f"l{i}.attn_norm", x, p + "input_layernorm.weight")
        bias = a + "qkv_proj.bias" if spec.qkv_bias else ""
        qkv = linear(f"l{i}.qkv", n, a + "qkv_proj.weight", bias)
        if spec.qk_norm:
            qk = {"kind": "rms", "eps": spec.norm_eps, "group": d}
            qkv = node("norm", f"l{i}.qk_norm", [qkv, a + "qk_norm.weight"],
                       (rows, spec.qkv_width), qk)  # fmt: skip
        r = node("rope", f"l{i}.rope", [qkv, "pos", ROPE_COS, ROPE_SIN], (rows, spec.qkv_width),
                 {"heads": h + hkv, "head_dim": d})  # fmt: skip
        attn = {"heads": h, "kv_heads": hkv, "head_dim": d, "scale": d**-0.5, "window": 0}
        att = node("attention", f"l{i}.attn", [r, "pos", "slot", kc, vc], (rows, h * d), attn)
        o_bias = a + "o_proj.bias" if spec.o_bias else ""
        x = add(f"l{i}.attn_res", x, linear(f"l{i}.o", att, a + "o_proj.weight", o_bias))
        n = norm(f"l{i}.mlp_norm", x, p + "post_attention_layernorm.weight")
        gu = linear(f"l{i}.gate_up", n, m + "gate_up_proj.weight")
        act = node("glu", f"l{i}.glu", [gu], (rows, spec.ffn), {"act": spec.act})
        x = add(f"l{i}.mlp_res", x, linear(f"l{i}.down", act, m + "down_proj.weight"))
    out_rows = rows
    if last_only and rows > 1:  # a prompt chunk: only its last token's logits are read
        x = node("rows", "last_row", [x], (1, spec.hidden), {"start": rows - 1, "count": 1})
        out_rows = 1
    n = node("norm", "final_norm", [x, "model.norm.weight"], (out_rows, spec.hidden),
             {"kind": "rms", "eps": spec.norm_eps})  # fmt: skip
    head = EMBED if spec.tied else "lm_head.weight"
    g.nodes.append(Node("linear", "lm_head", [n, head], ["logits"], dict(NONE), ["lm_head"]))
    g.shapes["logits"] = (out_rows, spec.vocab)
    return g
