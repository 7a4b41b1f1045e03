"""A Hugging Face decoder config as a ``DecoderSpec``: one row per architecture
(``ARCHS``), the config's values checked against what the graph builder does.

Every value the graphs depend on is read here, and a value edgepack does not implement
(an architecture, an activation, a RoPE scaling type, MLP biases...) fails the build
naming it and the value, rather than packing a model that computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import PackError


@dataclass(frozen=True)
class Arch:
    """What differs between decoder families, as data (the graph builder branches on
    these fields, never on a model type)."""

    qkv_bias: str  # "config" (attention_bias), "always" (Qwen2) or "never"
    o_bias: str  # the output projection's: "config" (Llama's attention_bias) or "never"
    act: str  # the MLP's gate activation (kernels/ops.py GATE_ACTS)
    # config keys whose truthy value changes the model in a way the graph does not do
    refuse: tuple[str, ...] = ("mlp_bias",)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)


ARCHS: dict[str, Arch] = {
    "llama": Arch(qkv_bias="config", o_bias="config", act="silu"),
    # Qwen2 / Qwen2.5: biases on q, k and v only; a sliding window only when enabled
    "qwen2": Arch(qkv_bias="always", o_bias="never", act="silu",
                  refuse=("mlp_bias", "use_sliding_window")),
    # Qwen3: per-head q/k RMSNorms, biases as Llama's attention_bias
    "qwen3": Arch(qkv_bias="config", o_bias="config", act="silu",
                  refuse=("mlp_bias", "use_sliding_window"), qk_norm=True),
}
ROPE_TYPES = ("default", "linear", "llama3")


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

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def _need(cfg: dict, key: str, kind=int):
    v = cfg.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise PackError(f"config.json: {key!r} is {v!r}; expected {kind.__name__}")
    return v


def _rope(cfg: dict) -> tuple[float, dict]:
    """(theta, parameters) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise PackError(
            f"config.json: RoPE scaling {kind!r} is not supported (edgepack implements "
            f"{', '.join(ROPE_TYPES)})"
        )
    params["rope_type"] = kind
    return float(theta), params


def decoder_spec(cfg: dict) -> DecoderSpec:
    """The spec of a Hugging Face config, or PackError naming what edgepack lacks."""
    mt = cfg.get("model_type")
    if mt not in ARCHS:
        raise PackError(
            f"config.json: architecture {mt!r} ({', '.join(cfg.get('architectures') or [])}) "
            f"is not supported; edgepack packs {', '.join(ARCHS)}"
        )
    arch = ARCHS[mt]
    act = cfg.get("hidden_act", "silu")
    if act != arch.act:
        raise PackError(f"config.json: hidden_act {act!r} is not supported for {mt}")
    for k in arch.refuse:
        if cfg.get(k):
            raise PackError(f"config.json: {k} = {cfg[k]!r} is not supported for {mt}")
    hidden, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv:
        raise PackError(f"config.json: {heads} attention heads over {kv} kv heads")
    theta, rope = _rope(cfg)
    bias = {"config": bool(cfg.get("attention_bias")), "always": True, "never": False}
    return DecoderSpec(
        arch=mt,
        layers=_need(cfg, "num_hidden_layers"),
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
        tied=bool(cfg.get("tie_word_embeddings", False)),
        act=act,
        rope_theta=theta,
        rope=rope,
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
    )
