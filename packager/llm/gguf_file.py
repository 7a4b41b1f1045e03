"""Read a GGUF file (llama.cpp's format) as what the rest of packager/llm/ takes from a
Hugging Face folder: an HF-style config, the weights under HF names as float32, the
tokenizer as tokenizer.json bytes, and the chat template and end ids.

The file is read with the ``gguf`` package after bounded checks of our own (magic,
version, counts that fit the file), and every tensor's bytes must lie inside the file,
so a truncated or malformed file is refused with its path and the reason, never mapped
past its end. Quantized tensors are dequantized with ``gguf``'s reference
(``gguf.quants.dequantize``), then re-quantized by the bundle's ``--quant``;
``source_types`` says which GGUF types arrived, for ``info``.

llama.cpp's converter (convert_hf_to_gguf.py) permutes q and k rows into its
interleaved RoPE order for the Llama family only (``LlamaModel.permute``); those are
permuted back here, so the graphs use the rotate-half RoPE of the HF layout. Qwen2,
Qwen3 and Gemma 3 use NEOX RoPE, which is rotate-half already, and are written
unpermuted. Llama 3.1's llama3 RoPE scaling arrives as a ``rope_freqs`` tensor of
per-pair factors (``LlamaModel.generate_extra_tensors``; ggml divides each frequency by
its factor), carried as rope.py's ``factors`` type; ``rope.scaling.type`` linear as
``linear``.

Gemma 3 (``Gemma3Model``): the converter stored every norm weight as 1 + w, taken back
to w here (arch.py adds the 1 at pack time, as for an HF folder). What the file lacks is
taken as llama.cpp takes it (src/models/gemma3.cpp): every 6th layer full unless
``attention.sliding_window_pattern`` says, the sliding layers' base 10000 unless
``rope.freq_base_swa`` says and unscaled, the query scale 1/sqrt(head size) (1/sqrt(hidden
/ heads) for the 62-layer 27B), GELU-tanh.

Tokenizers: byte-level BPE (``tokenizer.ggml.model`` gpt2) with the pre-tokenizers of
``BPE_PRES``, and SentencePiece vocabularies (``llama``: Llama 2, TinyLlama, Mistral),
rebuilt as llama.cpp's llama-vocab.cpp tokenizes them.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import numpy as np

from ..ir import PackError

GGUF_MAGIC = b"GGUF"
# GGUF tensor names -> Hugging Face names, shared by every architecture (the layer's
# index goes in the braces)
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
_O_BIAS = {"attn_output.bias": "self_attn.o_proj.bias"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}  # fmt: skip
# Gemma 3's four norms per layer: ffn_norm is the one before the MLP there
# (llama.cpp's FFN_PRE_NORM), the attention and MLP outputs have one each
_GEMMA3_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# general.architecture -> what differs, as data. model_type: the HF family (arch.py
# ARCHS); permute_qk: llama.cpp interleaved the q/k rows (and biases) for its RoPE;
# layer: the per-layer tensors beyond the shared ones (or named otherwise than there);
# config: HF keys the architecture fixes; rope_freqs: llama.cpp reads a rope_freqs
# tensor for it (Llama 3.1's frequency factors); norm_shift: the converter added it to
# every norm weight (taken off here: the HF config's weights are w, the model's 1 + w);
# swa: (every n-th layer full, the sliding layers' RoPE base) that llama.cpp takes when
# the file names none; width_query_blocks: block counts whose query scale is
# 1/sqrt(hidden / heads) rather than 1/sqrt(head size) (llama.cpp's Gemma 3 27B rule);
# refuse: keys of the file whose truthy value edgepack does not implement.
GGUF_ARCHS: dict[str, dict] = {
    "llama": {"model_type": "llama", "permute_qk": True, "layer": _QKV_BIAS | _O_BIAS,
              "rope_freqs": True},
    "qwen2": {"model_type": "qwen2", "permute_qk": False, "layer": _QKV_BIAS},
    "qwen3": {"model_type": "qwen3", "permute_qk": False,
              "layer": _QKV_BIAS | _O_BIAS | _QK_NORM},
    # llama.cpp: convert_hf_to_gguf.py (conversion/gemma.py) Gemma3Model, src/models/gemma3.cpp
    "gemma3": {"model_type": "gemma3_text", "permute_qk": False,
               "layer": _QK_NORM | _GEMMA3_NORMS,
               "config": {"hidden_activation": "gelu_pytorch_tanh"}, "norm_shift": 1.0,
               "swa": (6, 10000.0), "width_query_blocks": (62,),
               "refuse": ("final_logit_softcapping",)},
}  # fmt: skip
ARCHS = tuple(GGUF_ARCHS)

# Split regexes of byte-level BPE pre-tokenizers: the "original regex from
# tokenizer.json" that llama.cpp's llama-vocab.cpp cites for each pre type (it runs a
# case-spelled equivalent of the (?i:...) group).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = "gpt2"  # ByteLevel's own regex (GPT-2's)
# tokenizer.ggml.pre -> (splits before the byte-level step, ignore_merges, BOS unless
# the file says), grouped as llama-vocab.cpp groups the names. "default" is read as
# GPT-2's split, as transformers reads it (llama.cpp has a regex set of its own for it).
BPE_PRES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2"), ((_GPT2,), False, False)),
    "smollm": ((r"\p{N}", _GPT2), False, False),  # each digit alone, then GPT-2's
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), ((_LLAMA3_SPLIT,), True, True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), ((_LLAMA3_SPLIT,), False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
                    ((_QWEN2_SPLIT,), False, False)),
    "tekken": ((_TEKKEN_SPLIT,), True, True),
}  # fmt: skip
TOKENIZER_MODELS = ("gpt2", "llama")
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


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


def _hf_name(name: str, row: dict) -> str | None:
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
        hf = row["layer"].get(parts[2]) or _LAYER.get(parts[2])
        return f"model.layers.{parts[1]}.{hf}" if hf else None
    return _TOP.get(name)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k permutation (rows of each head interleaved)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _special_tokens(tokens: list[str], kinds: list[int]) -> list:
    """Tokens llama.cpp matches whole in the text: control and unknown ones as special
    tokens, user-defined ones (``<think>``...) as plain added tokens."""
    from tokenizers import AddedToken

    return [
        AddedToken(t, special=k in (CONTROL, UNKNOWN), normalized=False)
        for t, k in zip(tokens, kinds)
        if k in (CONTROL, UNKNOWN, USER_DEFINED)
    ]


def _bpe(fields: dict, tokens: list[str], path: Path):
    """Byte-level BPE: the file's merges, split first as the pre-tokenizer names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRES:
        raise PackError(
            f"{path}: byte-level BPE pre-tokenizer {pre!r} is not supported (edgepack "
            f"rebuilds {', '.join(BPE_PRES)})"
        )
    splits, ignore_merges, bos = BPE_PRES[pre]
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits if r != _GPT2]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=_GPT2 in splits))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, bos


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first pairing: every split
    of a token into two tokens, the best-scored token's first (ties: the longer left
    piece, then the longer right one, then vocabulary order), as transformers' GGUF
    converter orders them."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score in zip(tokens, scores):
        pairs = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found += [(float(score), len(a), len(b), a, b) for a, b in pairs]
    found.sort(key=lambda m: m[:3], reverse=True)
    return [(a, b) for *_, a, b in found]


def _spm(fields: dict, tokens: list[str], path: Path):
    """A SentencePiece vocabulary as llama.cpp tokenizes it: spaces as "▁", one more in
    front of the text and after each special token (``add_space_prefix``), pieces
    merged best score first, bytes ``<0xNN>`` for what no piece covers."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) < len(tokens):
        raise PackError(f"{path}: {len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens")
    given = fields.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in given] if given else _score_merges(tokens, scores)
    kinds = fields.get("tokenizer.ggml.token_type") or []
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, k in enumerate(kinds) if k == UNKNOWN), 0)
    unk = tokens[unk] if 0 <= unk < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                               fuse_unk=True, byte_fallback=True))  # fmt: skip
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, True  # llama.cpp adds BOS to a SentencePiece vocabulary by default


# tokenizer.ggml.model -> its builder, and the BOS / EOS ids llama.cpp takes when the file
# names none (llama_vocab::impl::load)
_TOKENIZERS = {"gpt2": (_bpe, {}), "llama": (_spm, {"bos": 1, "eos": 2})}


def _special_id(fields: dict, which: str, tokens: list[str]) -> int | None:
    model = _TOKENIZERS.get(fields.get("tokenizer.ggml.model"), (None, {}))[1]
    i = fields.get(f"tokenizer.ggml.{which}_token_id", model.get(which))
    return int(i) if i is not None and 0 <= int(i) < len(tokens) else None


def _tokenizer_json(fields: dict, path: Path) -> bytes:
    """tokenizer.json for the file's vocabulary, adding BOS / EOS when the file says to
    (llama.cpp's default when it does not)."""
    from tokenizers import processors

    model = fields.get("tokenizer.ggml.model")
    if model not in _TOKENIZERS:
        raise PackError(
            f"{path}: tokenizer model {model!r} is not supported (edgepack rebuilds "
            f"{', '.join(TOKENIZER_MODELS)}: byte-level BPE and SentencePiece)"
        )
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise PackError(f"{path}: no tokenizer.ggml.tokens (a vocabulary is needed)")
    tok, bos_default = _TOKENIZERS[model][0](fields, tokens, path)
    kinds = fields.get("tokenizer.ggml.token_type") or []
    added = _special_tokens(tokens, kinds)
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    around = []
    for which, default, where in (("bos", bos_default, 0), ("eos", False, 1)):
        i = _special_id(fields, which, tokens)
        if i is not None and fields.get(f"tokenizer.ggml.add_{which}_token", default):
            around.append((where, tokens[i], i))
    if around:
        single = " ".join([t for w, t, _ in around if w == 0] + ["$A"] +
                          [t for w, t, _ in around if w == 1])  # fmt: skip
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, i) for _, t, i in around]
        )
    return tok.to_str().encode("utf-8")


def _rope_scaling(fields: dict, arch: str, path: Path) -> dict:
    """The RoPE scaling llama.cpp applies (llama-model.cpp load_hparams, llama-context.cpp):
    ``rope.scaling.factor`` (or the older ``rope.scale_linear``) divides the frequencies
    unless ``rope.scaling.type`` is "none"; a file naming no type is linear."""
    kind = fields.get(f"{arch}.rope.scaling.type", "linear")
    factor = fields.get(f"{arch}.rope.scaling.factor") or fields.get(f"{arch}.rope.scale_linear")
    if kind not in ("none", "linear"):
        raise PackError(f"{path}: RoPE scaling {kind!r} in a GGUF is not supported (edgepack "
                        "reads none and linear)")  # fmt: skip
    if kind == "linear" and factor and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    return {"rope_type": "default"}


def _sliding_layers(fields: dict, arch: str, swa: tuple[int, float], layers: int,
                    path: Path) -> dict:  # fmt: skip
    """HF layer_types, sliding_window and the sliding layers' RoPE base as llama.cpp reads
    them (src/models/gemma3.cpp, llama-model.cpp load_swa_pattern, set_swa_pattern): no
    ``attention.sliding_window`` (or 0), every layer full; else the layers that
    ``attention.sliding_window_pattern`` says (an array of flags, or every n-th layer
    full, 0: none; the row's n when absent) slide, rotating with
    ``rope.freq_base_swa`` (the row's base when absent) and no scaling."""
    window = fields.get(f"{arch}.attention.sliding_window") or 0
    if not window:
        return {"layer_types": ["full_attention"] * layers, "sliding_window": None}
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", swa[0])
    if isinstance(pattern, list):
        slide = [bool(x) for x in pattern]
        if len(slide) != layers:
            raise PackError(f"{path}: {arch}.attention.sliding_window_pattern has "
                            f"{len(slide)} flags for {layers} layers")  # fmt: skip
    else:
        n = int(pattern)
        slide = [n == 0 or i % n < n - 1 for i in range(layers)]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slide],
        "sliding_window": int(window),
        "rope_local_base_freq": float(fields.get(f"{arch}.rope.freq_base_swa", swa[1])),
    }


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
    if arch not in GGUF_ARCHS:
        raise PackError(
            f"{path}: GGUF architecture {arch!r} is not supported (edgepack reads "
            f"{', '.join(GGUF_ARCHS)})"
        )
    row = GGUF_ARCHS[arch]
    if not fields.get("tokenizer.ggml.tokens"):
        raise PackError(f"{path}: no tokenizer.ggml.tokens (a vocabulary is needed)")

    def key(k: str, default=None):
        return fields.get(f"{arch}.{k}", default)

    for k in row.get("refuse", ()):
        if key(k):
            raise PackError(f"{path}: {arch}.{k} = {key(k)!r} is not supported")
    heads, kv = key("attention.head_count"), key("attention.head_count_kv")
    head_dim = key("attention.key_length") or key("embedding_length") // heads
    for k in ("attention.value_length", "rope.dimension_count"):  # partial RoPE, MLA...
        if key(k) not in (None, head_dim):
            raise PackError(f"{path}: {arch}.{k} = {key(k)} with heads of {head_dim}")
    tensors = {t.name: t for t in r.tensors}
    layers, hidden = key("block_count"), key("embedding_length")
    config = {
        "model_type": row["model_type"],
        "architectures": [f"GGUF {arch}"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv or heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **row.get("config", {"hidden_act": "silu"}),
    }
    rope = _rope_scaling(fields, arch, path)
    freqs = tensors.pop("rope_freqs.weight", None) if row.get("rope_freqs") else None
    if freqs is not None:  # Llama 3.1's llama3 scaling, as the converter wrote it
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        if factors.size != head_dim // 2:
            raise PackError(f"{path}: rope_freqs.weight has {factors.size} factors for "
                            f"heads of {head_dim} ({head_dim // 2} rotated pairs)")  # fmt: skip
        rope = {**rope, "rope_type": "factors",
                "factors": [float(f) for f in factors.astype(np.float32)]}  # fmt: skip
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    if "swa" in row:
        config |= _sliding_layers(fields, arch, row["swa"], layers, path)
    if "width_query_blocks" in row:  # llama.cpp's f_attention_scale (the file has none)
        wide = layers in row["width_query_blocks"]
        config["query_pre_attn_scalar"] = hidden // heads if wide else head_dim
    weights = {}
    for name, t in tensors.items():
        hf = _hf_name(name, row)
        if hf is None:
            raise PackError(f"{path}: tensor {name!r} has no place in a {arch} decoder")
        try:
            w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as e:
            raise PackError(f"{path}: tensor {name!r} ({t.tensor_type.name}): {e}") from None
        if row["permute_qk"] and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, heads)
        elif row["permute_qk"] and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, kv or heads)
        if row.get("norm_shift") and name.endswith("norm.weight"):
            w = w - np.float32(row["norm_shift"])
        weights[hf] = (w, "F32")
    tokens = fields["tokenizer.ggml.tokens"]
    bos, eos = _special_id(fields, "bos", tokens), _special_id(fields, "eos", tokens)
    text = {
        "chat_template": fields.get("tokenizer.chat_template"),
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "eos_ids": [eos] if eos is not None else [],
    }  # fmt: skip
    types = Counter(t.tensor_type.name for t in r.tensors)
    return config, weights, _tokenizer_json(fields, path), text, dict(types)
