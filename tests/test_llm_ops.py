"""The decoder-LLM ops' NumPy references (kernels/ref/llm.py) against PyTorch and
transformers' own modules: the references every LLM kernel is then tested against
must themselves mean what the models mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from edgepack.kernels import ops
from edgepack.kernels.ref.reference import REFERENCE
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama

pytestmark = pytest.mark.cpu

RNG = np.random.default_rng(11)


def _f32(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _close(got: np.ndarray, want, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _run(op: str, inputs: list, attrs: dict) -> np.ndarray:
    shapes = [None if a is None else tuple(np.shape(a)) for a in inputs]
    y = REFERENCE[op](inputs, attrs)
    assert y.shape == ops.output_shape(op, shapes, attrs)  # the table agrees
    return y


def test_rmsnorm_is_llamas():
    x, w = _f32(5, 64), _f32(64)
    mod = modeling_llama.LlamaRMSNorm(64, eps=1e-6)
    mod.weight.data = torch.from_numpy(w)
    _close(_run("norm", [x, w], {"kind": "rms", "eps": 1e-6}), mod(torch.from_numpy(x)))


def test_layernorm_is_torchs():
    x, w, b = _f32(3, 7, 48), _f32(48), _f32(48)
    want = F.layer_norm(torch.from_numpy(x), (48,), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    _close(_run("norm", [x, w, b], {"kind": "layer", "eps": 1e-5}), want)


def test_rope_is_llamas_at_any_positions():
    # The tables are what transformers' rotary module computes (cos = cat(f, f)): the
    # op takes their first half, and rotates q and k heads in one fused qkv row.
    h, hkv, d = 4, 2, 32
    cfg = LlamaConfig(
        hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hkv, head_dim=d,
        max_position_embeddings=512,
    )  # fmt: skip
    rot = modeling_llama.LlamaRotaryEmbedding(cfg)
    table = torch.arange(300)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), table)
    cos_t, sin_t = cos[0, :, : d // 2].numpy(), sin[0, :, : d // 2].numpy()
    pos = np.array([0, 3, 17, 255, 299, 4], np.int32)
    qkv = _f32(len(pos), (h + 2 * hkv) * d)
    got = _run("rope", [qkv, pos, cos_t, sin_t], {"heads": h + hkv, "head_dim": d})
    q = torch.from_numpy(qkv[:, : h * d].reshape(1, -1, h, d)).transpose(1, 2)
    k = torch.from_numpy(qkv[:, h * d : (h + hkv) * d].reshape(1, -1, hkv, d)).transpose(1, 2)
    c, s = rot(q, torch.from_numpy(pos.astype(np.int64))[None])
    qr, kr = modeling_llama.apply_rotary_pos_emb(q, k, c, s)
    _close(got[:, : h * d], qr.transpose(1, 2).reshape(len(pos), -1))
    _close(got[:, h * d : (h + hkv) * d], kr.transpose(1, 2).reshape(len(pos), -1))
    np.testing.assert_array_equal(got[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # v as is


def test_partial_rope_leaves_the_rest_of_each_head():
    d, half = 16, 4  # 8 of 16 dims rotated
    x, pos = _f32(3, 2 * d), np.array([1, 2, 9], np.int32)
    cos, sin = _f32(10, half), _f32(10, half)
    y = _run("rope", [x, pos, cos, sin], {"heads": 2, "head_dim": d})
    for head in range(2):
        np.testing.assert_array_equal(y[:, head * d + 2 * half : (head + 1) * d],
                                      x[:, head * d + 2 * half : (head + 1) * d])  # fmt: skip


@pytest.mark.parametrize(
    ("act", "fn"),
    [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))],
)
def test_glu_is_gate_times_up(act, fn):
    x = _f32(3, 2, 40)
    g, u = torch.from_numpy(x[..., :20]), torch.from_numpy(x[..., 20:])
    _close(_run("glu", [x], {"act": act}), fn(g) * u)


def test_embed_gathers_and_scales_rows():
    w, ids = _f32(50, 24), np.array([[3, 0, 49], [7, 7, 1]], np.int32)
    want = F.embedding(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(w)) * 24**0.5
    _close(_run("embed", [ids, w], {"mul": 24**0.5}), want)
    q = RNG.integers(-127, 128, (50, 24)).astype(np.int8)
    scale = RNG.uniform(0.01, 0.1, 50).astype(np.float32)
    _close(_run("embed", [ids, q, scale], {}), (q.astype(np.float32) * scale[:, None])[ids])


def _sdpa(q, k, v, scale, window=0, softcap=0.0):
    """torch's attention of q[H, Tq, D] (the last Tq positions of the T keys) over
    k, v[Hkv, T, D], causal, with GQA and an optional sliding window."""
    h, tq, _ = q.shape
    t = k.shape[1]
    k = k.repeat_interleave(h // k.shape[0], 0)
    v = v.repeat_interleave(h // v.shape[0], 0)
    qpos = torch.arange(t - tq, t)[:, None]
    kpos = torch.arange(t)[None]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    sc = softcap * torch.tanh(q @ k.transpose(1, 2) * scale / softcap)
    return torch.softmax(sc.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize(
    ("cache_dtype", "window", "softcap"),
    [(np.float32, 0, 0.0), (np.float16, 0, 0.0), (np.float32, 5, 0.0), (np.float32, 0, 30.0)],
)
def test_attention_over_the_cache_is_sdpa(cache_dtype, window, softcap):
    # Two sequences in a 2-slot cache: slot 1 takes a 9-row prompt chunk, then slot 0 a
    # 4-row one with an idle row, then one decode row each in the same call; every
    # call's output against torch over the full causal history so far.
    h, hkv, d, ctx = 6, 2, 16, 32
    attrs = {"heads": h, "kv_heads": hkv, "head_dim": d, "scale": d**-0.5, "window": window}
    if softcap:
        attrs["softcap"] = softcap
    kc = np.zeros((2, ctx, hkv, d), cache_dtype)
    vc = np.zeros_like(kc)
    hist = {0: [], 1: []}  # per slot: the rows' (k, v) as the cache holds them
    for rows in ([(1, p) for p in range(9)], [(0, 0), (0, 1), (-1, 0), (0, 2), (0, 3)],
                 [(0, 4), (1, 9)]):  # fmt: skip
        slot = np.array([s for s, _ in rows], np.int32)
        pos = np.array([p for _, p in rows], np.int32)
        qkv = _f32(len(rows), (h + 2 * hkv) * d)
        got = _run("attention", [qkv, pos, slot, kc, vc], attrs)
        for i, (s, p) in enumerate(rows):
            if s < 0:
                np.testing.assert_array_equal(got[i], 0)
                continue
            k = qkv[i, h * d : (h + hkv) * d].reshape(hkv, d).astype(cache_dtype)
            v = qkv[i, (h + hkv) * d :].reshape(hkv, d).astype(cache_dtype)
            assert len(hist[s]) == p
            hist[s].append((k.astype(np.float32), v.astype(np.float32)))
        for i, (s, p) in enumerate(rows):
            if s < 0:
                continue
            ks = torch.from_numpy(np.stack([kv[0] for kv in hist[s][: p + 1]], 1))
            vs = torch.from_numpy(np.stack([kv[1] for kv in hist[s][: p + 1]], 1))
            q = torch.from_numpy(qkv[i, : h * d].reshape(h, 1, d))
            want = _sdpa(q, ks, vs, d**-0.5, window, softcap).reshape(-1)
            _close(got[i], want, rtol=1e-4, atol=1e-5)
    # the caches hold exactly the rows stored, in the caches' dtype
    stored = np.stack([kv[0] for kv in hist[1]])
    np.testing.assert_array_equal(kc[1, :10].astype(np.float32), stored)


def test_the_op_table_refuses_llm_nodes_that_do_not_fit():
    attrs = {"heads": 6, "kv_heads": 4, "head_dim": 16, "scale": 0.25, "window": 0}
    with pytest.raises(ops.OpError, match="6 heads, 4 kv heads"):
        ops.output_shape("attention", [(1, 224), (1,), (1,), (2, 8, 4, 16), (2, 8, 4, 16)], attrs)
    with pytest.raises(ops.OpError, match="norm kind 'batch'"):
        ops.output_shape("norm", [(2, 8), (8,)], {"kind": "batch", "eps": 1e-5})
    with pytest.raises(ops.OpError, match="glu 'relu'"):
        ops.output_shape("glu", [(2, 8)], {"act": "relu"})
