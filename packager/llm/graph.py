"""The decoder as an IR graph over T rows (tokens): one graph per shape the runtime runs,
prefill (a chunk of one prompt, T = chunk) and decode (T = one row per sequence slot),
over the same constants and the same KV cache (the graphs' state).

Per layer: norm -> one q/k/v projection (the three stored as one matrix, decided here)
-> (Qwen3, Gemma 3) an RMSNorm of each q and k head -> rope on the q and k heads
(Gemma 3's sliding layers: their own tables) -> attention over the cache (a sliding
window where the layer has one) -> output projection -> (Gemma) norm -> residual add
-> norm -> one gate/up projection -> glu -> down projection -> (Gemma) norm -> residual
add. Then the final norm and the output projection (the embedding table itself when
tied). Gemma's embedding rows are scaled by sqrt(hidden) in the embed node.

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
ROPE_LOCAL_COS, ROPE_LOCAL_SIN = "rope_local.cos", "rope_local.sin"  # sliding layers'


def kv_names(layer: int) -> tuple[str, str]:
    return f"k_cache.{layer}", f"v_cache.{layer}"


def _norm_names(spec: DecoderSpec) -> tuple[str, ...]:
    """A layer's RMSNorm weights: before attention and before the MLP (Llama calls the
    latter post_attention_layernorm), and with ``post_norms`` (Gemma) after each too,
    where post_attention_layernorm is the attention output's."""
    names = ("input_layernorm", "post_attention_layernorm")
    if spec.post_norms:
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return tuple(f"{n}.weight" for n in names)


def fused_weights(spec: DecoderSpec, w) -> dict[str, np.ndarray]:
    """The graph's constants, float32, from ``w(name)`` (an HF tensor as float32, or
    None when absent): q/k/v and gate/up concatenated along the output axis, the
    RMSNorm weights with ``spec.norm_offset`` added (Gemma's 1 + w, in float32 as
    transformers forms it)."""

    def norm_w(name: str) -> np.ndarray:
        v = w(name)
        return v + np.float32(spec.norm_offset) if spec.norm_offset else v

    out = {EMBED: w(EMBED)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in _norm_names(spec):
            out[p + n] = norm_w(p + n)
        out[a + "qkv_proj.weight"] = np.concatenate([w(a + f"{x}_proj.weight") for x in "qkv"])
        if spec.qkv_bias:
            out[a + "qkv_proj.bias"] = np.concatenate([w(a + f"{x}_proj.bias") for x in "qkv"])
        if spec.qk_norm:  # one weight over q's and k's heads: each head's tiled (ops norm)
            out[a + "qk_norm.weight"] = np.concatenate(
                [np.tile(norm_w(a + "q_norm.weight"), spec.heads),
                 np.tile(norm_w(a + "k_norm.weight"), spec.kv_heads)]
            )  # fmt: skip
        out[a + "o_proj.weight"] = w(a + "o_proj.weight")
        if spec.o_bias:
            out[a + "o_proj.bias"] = w(a + "o_proj.bias")
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = np.concatenate(
            [w(m + "gate_proj.weight"), w(m + "up_proj.weight")]
        )
        out[m + "down_proj.weight"] = w(m + "down_proj.weight")
    out["model.norm.weight"] = norm_w("model.norm.weight")
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

    mul = {"mul": spec.embed_mul} if spec.embed_mul != 1.0 else {}
    x = node("embed", "embed", ["ids", EMBED], (rows, spec.hidden), mul)
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
        window = spec.window(i)
        cos, sin = (ROPE_LOCAL_COS, ROPE_LOCAL_SIN) if window and spec.rope_local_theta else (
            ROPE_COS, ROPE_SIN)  # fmt: skip
        r = node("rope", f"l{i}.rope", [qkv, "pos", cos, sin], (rows, spec.qkv_width),
                 {"heads": h + hkv, "head_dim": d})  # fmt: skip
        attn = {"heads": h, "kv_heads": hkv, "head_dim": d,
                "scale": spec.attn_scale or d**-0.5, "window": window}  # fmt: skip
        att = node("attention", f"l{i}.attn", [r, "pos", "slot", kc, vc], (rows, h * d), attn)
        o_bias = a + "o_proj.bias" if spec.o_bias else ""
        o = linear(f"l{i}.o", att, a + "o_proj.weight", o_bias)
        if spec.post_norms:
            o = norm(f"l{i}.attn_post_norm", o, p + "post_attention_layernorm.weight")
        x = add(f"l{i}.attn_res", x, o)
        pre = "pre_feedforward_layernorm" if spec.post_norms else "post_attention_layernorm"
        n = norm(f"l{i}.mlp_norm", x, p + pre + ".weight")
        gu = linear(f"l{i}.gate_up", n, m + "gate_up_proj.weight")
        act = node("glu", f"l{i}.glu", [gu], (rows, spec.ffn), {"act": spec.act})
        y = linear(f"l{i}.down", act, m + "down_proj.weight")
        if spec.post_norms:
            y = norm(f"l{i}.mlp_post_norm", y, p + "post_feedforward_layernorm.weight")
        x = add(f"l{i}.mlp_res", x, y)
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
