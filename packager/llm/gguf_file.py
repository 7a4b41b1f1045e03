"""Read a GGUF file (llama.cpp's format) as what the rest of packager/llm/ takes from a
Hugging Face folder: an HF-style config, the weights under HF names as float32, the
tokenizer as tokenizer.json bytes, and the chat template and end ids.

The file is read with the ``gguf`` package after bounded checks of our own (magic,
version, counts that fit the file), and every tensor's bytes must lie inside the file,
so a truncated or malformed file is refused with its path and the reason, never mapped
past its end. Quantized tensors are dequantized with ``gguf``'s reference
(``gguf.quants.dequantize``), then re-quantized by the bundle's ``--quant``;
``source_types`` says which GGUF types arrived, for ``info``.

llama.cpp's converter permutes Llama's q and k rows into its interleaved RoPE order;
they are permuted back here, so the graphs use the rotate-half RoPE of the HF layout.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import numpy as np

from ..ir import PackError

GGUF_MAGIC = b"GGUF"
ARCHS = ("llama",)
# GGUF tensor names -> Hugging Face names (the layer index goes in the braces)
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# Byte-level BPE pre-tokenizers edgepack rebuilds (tokenizer.ggml.pre): GPT-2's split.
GPT2_PRES = ("default", "gpt-2", "gpt2", "smollm")


def _bad(path: Path, what: str) -> PackError:
    return PackError(f"{path}: not a valid GGUF file: {what}")


def _precheck(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise _bad(path, "no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3):
        raise _bad(path, f"version {version} (edgepack reads 2 and 3)")
    # each key-value pair and tensor entry takes at least a dozen bytes
    if (n_tensors + n_kv) * 12 > size:
        raise _bad(path, f"{n_tensors} tensors and {n_kv} keys cannot fit {size} bytes")


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key = ".".join(["blk", "{}", *parts[2:]])
        return _NAMES[key].format(parts[1]) if key in _NAMES else None
    return _NAMES.get(name)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k permutation (rows of each head interleaved)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _tokenizer_json(fields: dict, path: Path) -> bytes:
    """tokenizer.json for a byte-level BPE vocabulary (``tokenizer.ggml.model`` gpt2),
    adding BOS when the file says to."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in GPT2_PRES:
        raise PackError(
            f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported "
            f"(edgepack rebuilds byte-level BPE with {', '.join(GPT2_PRES)})"
        )
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise PackError(f"{path}: no tokenizer.ggml.tokens (a vocabulary is needed)")
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    kinds = fields.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == 3]
    )
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if bos is not None and fields.get("tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], int(bos))]
        )
    return tok.to_str().encode("utf-8")


def load_gguf(path: str | Path) -> tuple[dict, dict, bytes, dict, dict]:
    """(HF-style config, {HF name: (float32 array, "F32")}, tokenizer.json bytes, text
    facts, GGUF tensor types counted) of a GGUF file."""
    import gguf

    path = Path(path)
    _precheck(path)
    try:
        r = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in r.fields.items()}
    except (ValueError, IndexError, KeyError, struct.error, OverflowError, MemoryError) as e:
        raise _bad(path, f"{type(e).__name__}: {e}") from None
    size = path.stat().st_size
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size:
            raise _bad(path, f"tensor {t.name!r} runs past the end of the file")
    arch = fields.get("general.architecture")
    if arch not in ARCHS:
        raise PackError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHS)})")

    if not fields.get("tokenizer.ggml.tokens"):
        raise PackError(f"{path}: no tokenizer.ggml.tokens (a vocabulary is needed)")

    def key(k: str, default=None):
        return fields.get(f"{arch}.{k}", default)

    heads, kv = key("attention.head_count"), key("attention.head_count_kv")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise PackError(f"{path}: RoPE scaling {scaling!r} in a GGUF is not supported yet")
    tensors = {t.name: t for t in r.tensors}
    config = {
        "model_type": arch,
        "architectures": [f"GGUF {arch}"],
        "num_hidden_layers": key("block_count"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv or heads,
        "head_dim": key("attention.key_length") or key("embedding_length") // heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
    }
    weights = {}
    for name, t in tensors.items():
        hf = _hf_name(name)
        if hf is None:
            raise PackError(f"{path}: tensor {name!r} has no place in a {arch} decoder")
        try:
            w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as e:
            raise PackError(f"{path}: tensor {name!r} ({t.tensor_type.name}): {e}") from None
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, kv or heads)
        weights[hf] = (w, "F32")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    tokens = fields["tokenizer.ggml.tokens"]
    bos = fields.get("tokenizer.ggml.bos_token_id")
    text = {
        "chat_template": fields.get("tokenizer.chat_template"),
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "eos_ids": [int(eos)] if eos is not None else [],
    }  # fmt: skip
    types = Counter(t.tensor_type.name for t in r.tensors)
    return config, weights, _tokenizer_json(fields, path), text, dict(types)
