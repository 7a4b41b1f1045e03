"""NumPy references of the decoder-LLM ops (kernels/ops.py; docs/bundle-format.md,
"LLM ops"). Rows are tokens: a node computes T rows at once, T = 1 per sequence in
decode, a chunk of one sequence's prompt in prefill.

Like every reference: float64 inside, obviously right, allocating freely. The
``attention`` reference writes the rows' keys and values into the caches it is given
(the arena's KV cache), rounded to the caches' dtype, before it attends: that store is
part of the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..ops import GATE_ACTS, NORM_KINDS, args
from ..wtypes import DEQUANTIZE, channel_scaled, of_array

Array = np.ndarray


def norm(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """RMSNorm (``kind`` rms: x / sqrt(mean(x²) + eps) * w) or LayerNorm (``layer``:
    the mean removed first, plus ``b``), over the last axis; with ``group`` G over each
    run of G values of the first len(w) columns (Qwen3's per-head q and k norms, their
    weights tiled per head), the columns past them copied."""
    io = args("norm", inputs)
    n, g = io.w.shape[0], int(attrs.get("group", io.x.shape[-1]))
    out = io.x.astype(np.float32).copy()
    x = io.x[..., :n].astype(np.float64).reshape(*io.x.shape[:-1], n // g, g)
    if attrs["kind"] == "layer":
        x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + float(attrs["eps"]))
    y = y.reshape(*io.x.shape[:-1], n) * io.w
    if io.b is not None:
        y = y + io.b
    out[..., :n] = y
    return out


def rope(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Rotary embedding of the first ``heads`` heads (``head_dim`` wide) of each row of
    x[T, W], at row t's position ``pos[t]``, rotate-half pairing (HF's layout: dim i
    with i + R/2, R = 2 * cos.shape[1] rotated dims per head, the rest unchanged):
    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. ``cos``/``sin`` [P, R/2] are the
    packager's tables (frequencies and any scaling already in them)."""
    io = args("rope", inputs)
    t, h, d = io.x.shape[0], int(attrs["heads"]), int(attrs["head_dim"])
    half = io.cos.shape[1]
    y = io.x.astype(np.float32).copy()
    heads = y[:, : h * d].reshape(t, h, d)
    c = io.cos[io.pos].astype(np.float64)[:, None, :]
    s = io.sin[io.pos].astype(np.float64)[:, None, :]
    x1 = heads[..., :half].astype(np.float64)
    x2 = heads[..., half : 2 * half].astype(np.float64)
    heads[..., :half] = x1 * c - x2 * s
    heads[..., half : 2 * half] = x2 * c + x1 * s
    return y


def _gelu_tanh(g: Array) -> Array:
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


GATES = {
    "silu": lambda g: g / (1.0 + np.exp(-g)),
    "gelu_tanh": _gelu_tanh,
}
assert tuple(GATES) == GATE_ACTS and NORM_KINDS == ("rms", "layer")


def glu(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Gated unit over x[..., 2F] = [gate | up]: act(gate) * up (SwiGLU with ``silu``,
    GeGLU with ``gelu_tanh``)."""
    x = inputs[0].astype(np.float64)
    f = x.shape[-1] // 2
    return (GATES[attrs["act"]](x[..., :f]) * x[..., f:]).astype(np.float32)


def embed(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Rows ``ids`` of the table w[V, D] (per-row int8 scale when given), times the
    optional attribute ``mul`` (Gemma's sqrt(D))."""
    io = args("embed", inputs)
    ids = np.asarray(io.ids, np.int64).reshape(-1)
    rows = io.w[ids]
    if rows.dtype != np.float32:  # f16, i8 (bf16 and i4 arrive decoded: node_weights)
        rows = DEQUANTIZE[of_array(rows)](rows, None)
    if io.scale is not None:
        rows = channel_scaled(rows, io.scale[ids])
    y = rows.astype(np.float64) * float(attrs.get("mul", 1.0))
    return y.reshape(*np.shape(io.ids), -1).astype(np.float32)


def attention(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Causal attention of each row over its sequence's KV cache.

    qkv[T, (H + 2*Hkv) * D] holds each row's query, key and value heads (after RoPE);
    row t belongs to sequence ``slot[t]`` at position ``pos[t]`` (a row with slot < 0
    is idle: nothing stored, output zero). First every row's key and value are stored
    at k_cache/v_cache[slot, pos] ([S, C, Hkv, D], rounded to the caches' dtype); then
    query head h of row t attends, with kv head h // (H / Hkv) (grouped-query), over
    the positions lo..pos[t] of its slot, lo = pos - window + 1 with a sliding
    ``window`` (0: none, lo = 0); scores times ``scale``, tanh-capped at ``softcap``
    when given, softmax, weighted sum of the values."""
    io = args("attention", inputs)
    h, hkv, d = int(attrs["heads"]), int(attrs["kv_heads"]), int(attrs["head_dim"])
    window, cap = int(attrs["window"]), float(attrs.get("softcap", 0.0))
    t = io.qkv.shape[0]
    qkv = io.qkv.astype(np.float32)
    q = qkv[:, : h * d].reshape(t, h, d).astype(np.float64)
    k = qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].reshape(t, hkv, d)
    kc, vc = io.k_cache, io.v_cache
    live = [i for i in range(t) if io.slot[i] >= 0]
    for i in live:
        kc[io.slot[i], io.pos[i]] = k[i]
        vc[io.slot[i], io.pos[i]] = v[i]
    out = np.zeros((t, h * d), np.float32)
    group = h // hkv
    for i in live:
        s, p = int(io.slot[i]), int(io.pos[i])
        lo = max(0, p - window + 1) if window else 0
        keys = kc[s, lo : p + 1].astype(np.float64)  # [L, Hkv, D]
        vals = vc[s, lo : p + 1].astype(np.float64)
        for head in range(h):
            sc = keys[:, head // group] @ q[i, head] * float(attrs["scale"])
            if cap:
                sc = cap * np.tanh(sc / cap)
            w = np.exp(sc - sc.max())
            out[i, head * d : (head + 1) * d] = (w / w.sum()) @ vals[:, head // group]
    return out


LLM_REFERENCE = {
    "norm": norm,
    "rope": rope,
    "glu": glu,
    "embed": embed,
    "attention": attention,
}
