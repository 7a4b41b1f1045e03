"""A Hugging Face decoder config as a ``DecoderSpec``: one row per architecture
(``ARCHS``), the config's values checked against what the graph builder does.

Every value the graphs depend on is read here, and a value edgepack does not implement
(an architecture, an activation, a RoPE scaling type, MLP biases...) fails the build
naming it and the value, rather than packing a model that computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import PackError


@dataclass(frozen=True)
class Arch:
    """What differs between decoder families, as data (the graph builder branches on
    these fields, never on a model type)."""

    qkv_bias: str  # "config" (attention_bias), "always" (Qwen2) or "never"
    o_bias: str  # the output projection's: "config" (Llama's attention_bias) or "never"
    acts: tuple[str, ...] = ("silu",)  # gate activations (HF names, HF_ACTS) it may use
    # config keys whose truthy value changes the model in a way the graph does not do
    refuse: tuple[str, ...] = ("mlp_bias",)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    # Gemma: RMSNorm weights stored as w - 1 (the model multiplies by 1 + w), the
    # embedding rows times sqrt(hidden), norms after attention and the MLP as well as
    # before, a query scale from query_pre_attn_scalar, sliding-window layers with their
    # own RoPE base (layer_types).
    gemma: bool = False


ARCHS: dict[str, Arch] = {
    "llama": Arch(qkv_bias="config", o_bias="config"),
    # Qwen2 / Qwen2.5: biases on q, k and v only; a sliding window only when enabled
    "qwen2": Arch(qkv_bias="always", o_bias="never", refuse=("mlp_bias", "use_sliding_window")),
    # Qwen3: per-head q/k RMSNorms, biases as Llama's attention_bias
    "qwen3": Arch(qkv_bias="config", o_bias="config",
                  refuse=("mlp_bias", "use_sliding_window"), qk_norm=True),
    # Gemma 3 (text; the 1B model, and the language model of the larger ones' folders)
    "gemma3_text": Arch(qkv_bias="config", o_bias="config", acts=("gelu_pytorch_tanh",),
                        refuse=("attn_logit_softcapping", "final_logit_softcapping",
                                "use_bidirectional_attention"),
                        qk_norm=True, gemma=True),
}  # fmt: skip
# Hugging Face activation names -> the glu op's (kernels/ops.py GATE_ACTS)
HF_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "factors")  # factors: a GGUF's rope_freqs
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DecoderSpec:
    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tied: bool
    act: str
    rope_theta: float
    rope: dict  # rope_type and its parameters (rope.py)
    max_positions: int
    attn_scale: float = 0.0  # the scores' scale (0: head_dim ** -0.5)
    embed_mul: float = 1.0  # the embedding rows' factor (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # added to every RMSNorm weight at pack time (Gemma: 1)
    post_norms: bool = False  # RMSNorms of the attention and MLP outputs (Gemma)
    windows: tuple[int, ...] = ()  # per layer: sliding window (0: full); () all full
    rope_local_theta: float = 0.0  # sliding layers' RoPE base (0: the same tables)
    rope_local: dict | None = None  # and its scaling parameters

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def _need(cfg: dict, key: str, kind=int):
    v = cfg.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise PackError(f"config.json: {key!r} is {v!r}; expected {kind.__name__}")
    return v


def _rope_params(params: dict, theta: float, what: str = "") -> tuple[float, dict]:
    params = dict(params)
    theta = params.pop("rope_theta", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise PackError(
            f"config.json: RoPE scaling {kind!r}{what} is not supported (edgepack implements "
            f"{', '.join(ROPE_TYPES)})"
        )
    params["rope_type"] = kind
    return float(theta), params


def _rope(cfg: dict) -> tuple[float, dict]:
    """(theta, parameters) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in params:  # per layer type (Gemma 3): the full layers' here
        return _rope_params(params["full_attention"], 1e6, " (full_attention)")
    return _rope_params(params, cfg.get("rope_theta", 10000.0))


def _local_rope(cfg: dict) -> tuple[float, dict]:
    """The sliding layers' (theta, parameters): transformers 5's
    rope_parameters["sliding_attention"], or the older rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _rope_params(params["sliding_attention"], 1e4, " (sliding_attention)")
    return float(cfg.get("rope_local_base_freq", 10000.0)), {"rope_type": "default"}


def _windows(cfg: dict, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), from ``layer_types`` or the
    older ``sliding_window_pattern`` (every n-th layer full)."""
    types = cfg.get("layer_types")
    if types is None:
        n = int(cfg.get("sliding_window_pattern", 6))
        types = [LAYER_TYPES[bool((i + 1) % n)] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise PackError(f"config.json: layer_types {types!r} does not give {layers} layers")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise PackError(f"config.json: layer type(s) {bad} are not supported")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise PackError(f"config.json: sliding_window {window!r} for sliding layers")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def decoder_spec(cfg: dict) -> DecoderSpec:
    """The spec of a Hugging Face config, or PackError naming what edgepack lacks."""
    mt = cfg.get("model_type")
    if mt not in ARCHS:
        raise PackError(
            f"config.json: architecture {mt!r} ({', '.join(cfg.get('architectures') or [])}) "
            f"is not supported; edgepack packs {', '.join(ARCHS)}"
        )
    arch = ARCHS[mt]
    key = "hidden_activation" if arch.gemma else "hidden_act"
    act = cfg.get(key) or arch.acts[0]
    if act not in arch.acts:
        raise PackError(f"config.json: {key} {act!r} is not supported for {mt}")
    for k in arch.refuse:
        if cfg.get(k):
            raise PackError(f"config.json: {k} = {cfg[k]!r} is not supported for {mt}")
    hidden, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv:
        raise PackError(f"config.json: {heads} attention heads over {kv} kv heads")
    layers = _need(cfg, "num_hidden_layers")
    theta, rope = _rope(cfg)
    bias = {"config": bool(cfg.get("attention_bias")), "always": True, "never": False}
    gemma = {}
    if arch.gemma:
        local_theta, local = _local_rope(cfg)
        gemma = {
            "attn_scale": float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            # transformers multiplies by the float32 (model dtype) sqrt
            "embed_mul": float(np.float32(hidden**0.5)),
            "norm_offset": 1.0,
            "post_norms": True,
            "windows": _windows(cfg, layers),
            "rope_local_theta": local_theta,
            "rope_local": local,
        }
    return DecoderSpec(
        arch=mt,
        layers=layers,
        hidden=hidden,
        ffn=_need(cfg, "intermediate_size"),
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        vocab=_need(cfg, "vocab_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bias[arch.qkv_bias],
        o_bias=bias[arch.o_bias],
        qk_norm=arch.qk_norm,
        tied=bool(cfg.get("tie_word_embeddings", arch.gemma)),
        act=HF_ACTS[act],
        rope_theta=theta,
        rope=rope,
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        **gemma,
    )
