"""Every GGUF tensor type issue 17 names imports: a tiny Llama written as a GGUF by this
test (gguf's GGUFWriter) with every projection in one type, packed fp32 by edgepack and
loaded by transformers from the same file (``gguf_file=``): the logits agree.

Types gguf-py can quantize (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) quantize random
weights; for the K-quants (Q2_K..Q6_K, which it only dequantizes) the blocks are random
bytes with their fp16 scale fields set to sane values, so any reader must decode the
same block layout. edgepack dequantizes them with gguf's reference (the build then
re-quantizes to --quant); ``quantization.source_types`` names what arrived.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from edgepack.packager.llm.build import build_llm
from edgepack.runtime.llm import LLMSession

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.cpu

HIDDEN, FFN, HEADS, KV, LAYERS = 256, 512, 4, 2, 1  # K-quant rows are multiples of 256
# byte offsets of the fp16 scale fields in each K-quant block (ggml-common.h)
K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
QUANTIZABLE = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a byte-level BPE vocabulary with no merges."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def _tensor(rng, shape: tuple[int, int], qtype) -> np.ndarray:
    """A [rows, K] weight stored as ``qtype``: the array GGUFWriter takes (raw blocks as
    uint8 for quantized types)."""
    if qtype in QUANTIZABLE:
        w = (rng.standard_normal(shape) * 0.08).astype(np.float32)
        return w.astype(np.float16) if qtype == T.F16 else gguf.quants.quantize(w, qtype)
    block, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, nbytes), dtype=np.uint8)
    for off in K_SCALES[qtype]:
        d = rng.uniform(0.001, 0.004, raw.shape[:2]).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def _write_gguf(path, qtype, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tokens = _byte_tokens() + ["<|end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_merges([])
    w.add_eos_token_id(len(tokens) - 1)
    vocab, hd = len(tokens), HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HEADS * hd, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV * hd, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV * hd, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * hd),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        data = _tensor(rng, shape, qtype)
        raw = None if data.dtype in (np.float32, np.float16) else qtype
        w.add_tensor(name, data, raw_dtype=raw)
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}" for i in range(LAYERS)
                                          for n in ("attn_norm.weight", "ffn_norm.weight")]:
        w.add_tensor(name, rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TYPES = [*QUANTIZABLE, *K_SCALES]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_gguf_tensor_type_imports_as_transformers_reads_it(tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    src = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(src, qtype)
    r = build_llm(src, tmp_path / "t.epk", quant="fp32", ctx=32, chunk=8, kv="f32",
                  log=lambda s: None)  # fmt: skip
    assert r.manifest["quantization"]["source_types"].get(qtype.name) == 8
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name).eval()
    ids = [5, 200, 17, 99, 3, 256, 42, 7, 150, 11]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    s = LLMSession(tmp_path / "t.epk")
    got = [s.prefill(ids[:6]).copy()] + [s.step(t).copy() for t in ids[6:]]
    scale = float(np.abs(want).max())
    for k, g in zip([5, 6, 7, 8, 9], got):
        np.testing.assert_allclose(g, want[k], rtol=1e-4, atol=1e-4 * scale, err_msg=f"{k}")


def test_q4_0_blocks_survive_int4_bit_for_bit(tmp_path):
    # ggml's Q4_0 puts each block's largest magnitude at code -8 (d = max / -8), which is
    # edgepack's int4 rule (kernels/wtypes.py): re-quantizing the dequantized blocks
    # gives the same codes and fp16 scales, so --quant int4 loses nothing more
    src = tmp_path / "q40.gguf"
    _write_gguf(src, T.Q4_0, seed=3)
    common = dict(ctx=32, chunk=8, kv="f32", quant_embed="fp32", log=lambda s: None)
    build_llm(src, tmp_path / "f.epk", quant="fp32", **common)
    r = build_llm(src, tmp_path / "q.epk", quant="int4", act_quant="none", **common)
    assert {w["dtype"] for w in r.manifest["weights"].values()} >= {"i4"}
    assert r.manifest["quantization"]["error"]["layers"]  # measured, and tiny:
    assert r.manifest["quantization"]["error"]["max_output_rel_l2"] < 1e-5
    ids = [5, 200, 17, 99, 3, 256]
    a, b = LLMSession(tmp_path / "f.epk").prefill(ids), LLMSession(tmp_path / "q.epk").prefill(ids)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
