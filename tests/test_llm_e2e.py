"""Decoder LLMs end to end through the bundle: random-weight Llama and Qwen2 models made
and saved by transformers -> build_llm -> .epk on disk -> mmap -> prefill in chunks + decode steps
over the planned KV cache, against transformers' logits on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_allocates_nothing
from edgepack.packager.ir import PackError
from edgepack.packager.llm.build import build_llm
from edgepack.runtime.llm import LLMError, LLMSession
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

pytestmark = pytest.mark.cpu

VOCAB = 96


# Gemma 3's own settings, small: a head size apart from hidden / heads, a query scale
# apart from the head size, a window of 6 (shorter than the tests' sequences) on two of
# three layers, linear RoPE scaling on the full layer and another base on the others.
GEMMA = {
    "num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 20, "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
}  # fmt: skip


def _llama(path, tied: bool, bias: bool, seed: int = 0, arch: str = "llama"):
    torch.manual_seed(seed)
    config, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                         "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                         "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                         "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[arch]  # fmt: skip
    cfg = config(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": tied,
        "initializer_range": 0.25,  # large enough that attention is far from uniform
        **({"attention_bias": bias} if arch != "qwen2" else {}),
        **({"head_dim": 16} if arch == "qwen3" else {}),
        **(GEMMA if arch == "gemma3" else {}),
    })  # fmt: skip
    model = model_cls(cfg).eval()
    with torch.no_grad():  # biases start at zero, norms at one (Gemma's at 0, for 1 + w):
        for name, p in model.named_parameters():  # values a dropped or misplaced one shows
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight") and arch == "gemma3":
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return model


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * float(np.abs(want).max()))


@pytest.fixture(
    scope="module",
    params=[
        ("llama", True, False),
        ("llama", False, True),
        ("qwen2", True, True),
        ("qwen3", False, False),
        ("gemma3", True, False),
    ],
    ids=["tied", "untied_bias", "qwen2", "qwen3", "gemma3"],
)
def llama(request, tmp_path_factory):
    arch, tied, bias = request.param
    d = tmp_path_factory.mktemp(arch)
    model = _llama(d / "hf", tied, bias, arch=arch)
    out = d / "llama.epk"
    build_llm(d / "hf", out, ctx=64, slots=2, chunk=4, kv="f32", log=lambda s: None)
    return model, out


def test_prefill_and_decode_match_transformers(llama):
    # an 11-token prompt in chunks of 4 (the last chunk with an idle row), then 32
    # greedy steps; every step's logits against transformers over the whole sequence
    model, path = llama
    s = LLMSession(path)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 11)]
    seq = list(prompt)
    got = s.prefill(prompt)
    _close(got, _hf_logits(model, seq)[-1], 1e-4)
    for _ in range(32):
        seq.append(int(np.argmax(got)))
        got = s.step(seq[-1])
        _close(got, _hf_logits(model, seq)[-1], 1e-4)
    assert s.positions[0] == len(seq)


def test_slots_are_separate_sequences(llama):
    # two prompts interleaved in the two cache slots give what each gives alone
    model, path = llama
    s = LLMSession(path)
    a, b = [5, 17, 3, 60, 2], [44, 1, 90, 90, 7, 12, 8]
    la, lb = s.prefill(a, slot=0).copy(), s.prefill(b, slot=1).copy()
    _close(la, _hf_logits(model, a)[-1], 1e-4)
    _close(lb, _hf_logits(model, b)[-1], 1e-4)
    ta, tb = int(np.argmax(la)), int(np.argmax(lb))
    _close(s.step(ta, slot=0), _hf_logits(model, a + [ta])[-1], 1e-4)
    _close(s.step(tb, slot=1), _hf_logits(model, b + [tb])[-1], 1e-4)
    s.reset(0)  # a new sequence in slot 0 starts from position 0
    _close(s.prefill(b, slot=0), _hf_logits(model, b)[-1], 1e-4)
    # keep: a prompt sharing the slot's first 5 positions (b's prompt, then its own
    # tokens) feeds only what follows them (the serving engine's prompt cache)
    s.step(int(np.argmax(lb)), slot=0)
    s.keep(0, 5)
    c = b[:5] + [30, 31, 32]
    _close(s.prefill(c[5:], slot=0), _hf_logits(model, c)[-1], 1e-4)
    with pytest.raises(LLMError, match="holds 8 positions, not 9"):
        s.keep(0, 9)
    # share: slot 1 starts with slot 0's first 6 positions, copied (every layer's keys
    # and values), and goes on by itself
    s.share(0, 1, 6)
    d = c[:6] + [9, 10]
    _close(s.prefill(d[6:], slot=1), _hf_logits(model, d)[-1], 1e-4)
    _close(s.step(4, slot=0), _hf_logits(model, c + [4])[-1], 1e-4)  # slot 0 as it was
    with pytest.raises(LLMError, match="slot 0 holds 9 positions; 10 of them"):
        s.share(0, 1, 10)


def test_decode_steps_of_several_sequences_on_every_row_count(tmp_path):
    # a 4-slot bundle carries decode graphs of 1, 2 and 4 rows; a step of k sequences
    # runs the smallest that holds them (row i naming its slot) and gives each
    # sequence what it gets alone, to the last bits when the same graph runs
    model = _llama(tmp_path / "hf", True, False)
    out = tmp_path / "four.epk"
    build_llm(tmp_path / "hf", out, ctx=64, slots=4, chunk=4, kv="f32", log=lambda s: None)
    assert sorted(LLMSession(out).bundle.manifest["llm"]["decode_rows"], key=int) == ["1", "2"]
    prompts = [[5, 17, 3], [44, 1, 90, 90], [7], [12, 8]]
    for rows in (0, 4):  # the smallest graph each time, then always the 4-row one
        s = LLMSession(out)
        last = [int(np.argmax(s.prefill(p, slot=i))) for i, p in enumerate(prompts)]
        seqs = [list(p) for p in prompts]
        for k in (3, 1, 4, 2):  # steps of 3, 1, 4 and 2 of the sequences
            slots = [(i * 3) % 4 for i in range(k)] if k < 4 else [2, 0, 3, 1]
            got = s.step_many(slots, [last[i] for i in slots], rows)
            for i, lg in zip(slots, got):
                seqs[i].append(last[i])
                want = _hf_logits(model, seqs[i])[-1]
                _close(lg, want, 1e-4)
                last[i] = int(np.argmax(lg))
    # bit for bit: a sequence alone and beside others on one graph
    s, r = LLMSession(out), LLMSession(out)
    for i, p in enumerate(prompts):
        s.prefill(p, slot=i)
        r.prefill(p, slot=i)
    together = [x.copy() for x in s.step_many([0, 1, 2, 3], [1, 2, 3, 4], rows=4)]
    alone = [r.step_many([i], [i + 1], rows=4)[0].copy() for i in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(together, alone))


def test_prompts_packed_into_one_chunk_read_only_their_own_sequence(tmp_path):
    # prefill_many: the serving engine packs several prompts (each but its last token)
    # into one chunk, rows naming their slots; each prompt's last token then goes
    # through a decode step with the others. Against transformers, and bit for bit
    # against the same prompts prefilled one by one.
    model = _llama(tmp_path / "hf", True, False)
    out = tmp_path / "packed.epk"
    build_llm(tmp_path / "hf", out, ctx=64, slots=4, chunk=8, kv="f32", log=lambda s: None)
    prompts = [[5, 17, 3], [44, 1, 90, 90, 6], [7, 9], [12, 8, 30, 2]]
    s, r = LLMSession(out), LLMSession(out)
    s.prefill_many([(0, prompts[0][:-1]), (1, prompts[1][:-1]), (2, prompts[2][:-1])])
    s.prefill_many([(3, prompts[3][:-1])])
    got = [x.copy() for x in s.step_many([0, 1, 2, 3], [p[-1] for p in prompts], rows=4)]
    for i, p in enumerate(prompts):
        _close(got[i], _hf_logits(model, p)[-1], 1e-4)
        r.prefill(p[:-1], slot=i)
    alone = r.step_many([0, 1, 2, 3], [p[-1] for p in prompts], rows=4)
    assert all(np.array_equal(a, b) for a, b in zip(got, alone))
    assert s.positions == [len(p) for p in prompts]
    with pytest.raises(LLMError, match="1 to 8 tokens, distinct slots"):
        s.prefill_many([(0, [1] * 5), (1, [2] * 4)])
    with pytest.raises(LLMError, match="distinct slots"):
        s.prefill_many([(0, [1]), (0, [2])])
    # step_rows: a decode run where sequences bring several tokens (a prompt's tail
    # beside the others' next tokens); the logits after each one's last token
    s = LLMSession(out)
    s.prefill_many([(1, prompts[1][:2])])
    seqs = [[], prompts[1][:2], [], []]
    items = [(0, prompts[0][1:]), (1, prompts[1][2:3]), (3, prompts[3][:1])]
    got = s.step_rows(items)
    for (slot, toks), lg in zip(items, got):
        seqs[slot] = seqs[slot] + list(toks)
        _close(lg, _hf_logits(model, seqs[slot])[-1], 1e-4)
    assert s.positions == [2, 3, 0, 1]
    with pytest.raises(LLMError, match="1 to 4 tokens"):
        s.step_rows([(0, [1, 2, 3]), (2, [4, 5])])


def test_the_bundle_records_the_kv_cache_and_refuses_a_full_context(llama):
    _, path = llama
    s = LLMSession(path)
    llm = s.bundle.manifest["llm"]
    state = s.bundle.manifest["graph"]["state"]
    layers, d = llm["spec"]["layers"], llm["spec"]["head_dim"]
    assert len(state) == 2 * layers  # k and v per layer
    # (k, v) per layer, each [2 slots, 64 positions, 2 kv heads, d] float32
    assert llm["kv_bytes"] == 2 * layers * (2 * 64 * 2 * d) * 4
    assert s.decode.arena is s.prefill_ex.arena  # one arena, one cache
    assert max(s.bundle.manifest["plan"]["tensors"][t] for t in state) < llm["kv_bytes"]
    with pytest.raises(LLMError, match="exceed the context of 64"):
        s.prefill([1] * 65)
    with pytest.raises(LLMError, match="token ids must lie in 0..95"):
        s.step(VOCAB)


def test_fp16_kv_cache_stays_close(tmp_path):
    model = _llama(tmp_path / "hf", tied=True, bias=False, seed=3)
    build_llm(tmp_path / "hf", tmp_path / "h.epk", ctx=48, chunk=8, kv="f16", log=lambda s: None)
    s = LLMSession(tmp_path / "h.epk")
    seq = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    got = s.prefill(seq)
    for _ in range(16):
        want = _hf_logits(model, seq)[-1]
        _close(got, want, 1e-2)  # keys and values rounded to half in the cache
        seq.append(int(np.argmax(want)))
        got = s.step(seq[-1])


def test_unsupported_configs_fail_the_build_naming_the_value(tmp_path):
    _llama(tmp_path / "hf", tied=True, bias=False)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, message in (
        ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "architecture 'mamba'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE scaling 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ):
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(PackError, match=message):
            build_llm(tmp_path / "hf", tmp_path / "x.epk", ctx=16, log=lambda s: None)


def test_gemma3_configs_of_either_transformers_generation_give_one_spec(tmp_path):
    """Hub configs written before transformers 5 give the RoPE bases as rope_theta and
    rope_local_base_freq (scaling in rope_scaling, for the full layers only) and the
    layer pattern as sliding_window_pattern; they mean what GEMMA's keys mean."""
    from edgepack.packager.llm.arch import decoder_spec

    _llama(tmp_path / "hf", tied=True, bias=False, arch="gemma3")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    old = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_parameters")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    new, legacy = decoder_spec(cfg), decoder_spec(old)
    assert new == legacy
    assert new.windows == (6, 0, 6) and new.attn_scale == 20**-0.5 and new.norm_offset == 1
    assert new.rope == {"rope_type": "linear", "factor": 2.0} and new.rope_local_theta == 1e4
    for change, message in (
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
        ({"layer_types": ["full_attention"]}, "does not give 3 layers"),
    ):
        with pytest.raises(PackError, match=message):
            decoder_spec({**cfg, **change})


def test_a_multimodal_gemma3_folder_packs_its_language_model(tmp_path):
    """Gemma 3's 4B and larger come as Gemma3ForConditionalGeneration (a vision tower
    beside the decoder, names under language_model.): the text decoder is packed, and
    its logits are the full model's on a text prompt."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(5)
    text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.25,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, **GEMMA}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                       eoi_token_index=VOCAB - 2)  # fmt: skip
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path / "hf")
    r = build_llm(tmp_path / "hf", tmp_path / "g.epk", ctx=32, chunk=4, kv="f32",
                  log=lambda s: None)  # fmt: skip
    assert r.manifest["llm"]["spec"]["arch"] == "gemma3_text"
    assert not any("vision" in k for k in r.manifest["weights"])
    s = LLMSession(tmp_path / "g.epk")
    seq = [int(t) for t in np.random.default_rng(6).integers(0, VOCAB - 3, 9)]
    got = s.prefill(seq)
    for _ in range(8):
        _close(got, _hf_logits(model, seq)[-1], 1e-4)
        seq.append(int(np.argmax(got)))
        got = s.step(seq[-1])


def test_a_corrupt_safetensors_file_is_refused_before_mapping(tmp_path):
    _llama(tmp_path / "hf", tied=True, bias=False)
    st = tmp_path / "hf" / "model.safetensors"
    data = bytearray(st.read_bytes())
    st.write_bytes(data[: len(data) // 2])  # truncated: offsets past the end
    with pytest.raises(PackError, match="not a valid safetensors file"):
        build_llm(tmp_path / "hf", tmp_path / "x.epk", ctx=16, log=lambda s: None)
    st.write_bytes(b"\xff" * 8 + data[8:])  # a header length of 2**64 - 1
    with pytest.raises(PackError, match="header length"):
        build_llm(tmp_path / "hf", tmp_path / "x.epk", ctx=16, log=lambda s: None)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    return float(np.sum(p * (np.log(p) - np.log(q))))


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True,
                      initializer_range=0.1)  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(d / "hf")
    return d


# (mode, mean KL bound, top-1 agreement bound) against the fp32 bundle over 33 positions.
# Measured on this random-weight model (a worst case: no structure for the scales to
# follow): fp16 KL 3.8e-7 / 1.00, bf16 2.0e-5 / 1.00, int8 3.9e-4 / 0.97, int4 4.6e-2 /
# 0.79.
# int4 with int8 activations (the xq attribute, integer products): KL 4.7e-2 / 0.76, near
# float activations (the weights' rounding dominates). int8 with int8 activations
# (q8x16.py on every projection): pack-time table KL 1.2e-3 / 0.98, against 8.6e-4 /
# 0.98 with float activations.
QUANT_BOUNDS = [("fp16", "none", 1e-5, 1.0), ("bf16", "none", 1e-3, 0.95),
                ("int8", "none", 2e-3, 0.95), ("int8", "int8", 5e-3, 0.95),
                ("int4", "none", 1e-1, 0.7),
                ("int4", "int8", 1e-1, 0.7)]  # fmt: skip


@pytest.mark.parametrize(("mode", "act", "kl_bound", "agree_bound"), QUANT_BOUNDS)
def test_quantized_bundles_stay_close_to_fp32(wide_llama, mode, act, kl_bound, agree_bound):
    ref_path, path = wide_llama / "fp32.epk", wide_llama / f"{mode}-{act}.epk"
    if not ref_path.exists():
        build_llm(wide_llama / "hf", ref_path, ctx=64, chunk=8, kv="f32", log=lambda s: None)
    r = build_llm(wide_llama / "hf", path, quant=mode, ctx=64, chunk=8, kv="f32",
                  act_quant=act, log=lambda s: None)  # fmt: skip
    types = {w["dtype"] for w in r.manifest["weights"].values()}
    want = {"fp16": "f16", "bf16": "bf16", "int8": "i8", "int4": "i4"}[mode]
    assert want in types
    m = r.manifest
    interleaved = 0
    for graph in (m["graph"], m["llm"]["prefill"]["graph"]):
        # xq exactly on the int4 linears and the int8 ones whose shape the interleaved
        # int8 kernel takes (N % 16, K % 32), and their kernels have it
        for n in graph["nodes"]:
            w = m["weights"][n["inputs"][1]] if n["op"] in ("linear", "embed") else None
            if n["op"] == "embed":  # a tied int8 table goes with the output projection
                x16 = n["inputs"][1].endswith(".x16")
                assert n["attrs"].get("interleave") == (16 if x16 else None), n["name"]
            if n["op"] != "linear":
                continue
            fits = w["shape"][0] % 16 == 0 and (w["dtype"] == "i4" or w["shape"][1] % 32 == 0)
            integer = w["dtype"] == "i4" or (w["dtype"] == "i8" and fits)
            assert n["attrs"].get("xq") == (32 if integer and act == "int8" else None), n["name"]
            if n["attrs"].get("xq"):  # rows interleaved by 16 where N allows it
                assert n["attrs"].get("interleave") == (16 if fits else None), n["name"]
                want = {"i8": "gemm_q8x16_q8", "i4": "gemm_q4x16_q8" if fits else "gemv_q4_q8"}
                assert n["kernel"]["variant"] == want[w["dtype"]], n["kernel"]
                interleaved += fits
    assert (interleaved > 0) == (act == "int8")
    assert m["quantization"]["activations"] == ("int8" if act == "int8" else "fp32")
    # the pack-time table: every node, and the next-token figures on the same footing as
    # this test's (the table reads seeded ids: the test model has no tokenizer)
    err = m["quantization"]["error"]
    assert len(err["layers"]) == len(m["graph"]["nodes"]) and err["tokens"] == 64
    assert 0 <= err["kl"] < kl_bound and err["top1"] >= agree_bound - 0.1
    assert err["ppl"] > 1 and err["ppl_fp32"] > 1 and "random token ids" in err["calibration"]
    ref, q = LLMSession(ref_path), LLMSession(path)
    seq = [int(t) for t in np.random.default_rng(4).integers(0, VOCAB, 8)]
    a, b = ref.prefill(seq).copy(), q.prefill(seq).copy()
    kls, agree = [_kl(a, b)], [int(np.argmax(a)) == int(np.argmax(b))]
    for _ in range(32):  # teacher-forced by the fp32 bundle's greedy tokens
        tok = int(np.argmax(a))
        a, b = ref.step(tok).copy(), q.step(tok).copy()
        kls.append(_kl(a, b))
        agree.append(int(np.argmax(a)) == int(np.argmax(b)))
    print(f"{mode}: mean KL {np.mean(kls):.2e}, top-1 agreement {np.mean(agree):.3f}")
    assert np.mean(kls) < kl_bound and np.mean(agree) >= agree_bound
    assert r.bundle_bytes < ref_path.stat().st_size


def test_max_error_gates_an_llm_build_on_kl(wide_llama, tmp_path):
    with pytest.raises(PackError, match="mean KL divergence .* exceeds --max-error 1e-09"):
        build_llm(wide_llama / "hf", tmp_path / "x.epk", quant="int4", ctx=16,
                  max_error=1e-9, log=lambda s: None)  # fmt: skip
    assert not (tmp_path / "x.epk").exists()
    r = build_llm(wide_llama / "hf", tmp_path / "y.epk", quant="int8", ctx=16, max_error=0.5,
                  log=lambda s: None)  # fmt: skip
    assert r.manifest["quantization"]["error"]["kl"] < 0.5


def test_the_decode_loop_allocates_nothing(llama):
    # as for the CNNs (test_memory.py): the steady-state step allocates nothing
    _, path = llama
    s = LLMSession(path)
    s.prefill([3, 1, 4, 1, 5])
    for _ in range(5):
        s.step(9)
    assert_allocates_nothing(lambda: s.step(9), runs=40)
    row = s.step(9)
    assert row is s.step(9)  # one view of the arena's logits, reused
    assert s.decode.arena.nbytes == s.bundle.manifest["plan"]["arena_bytes"]  # as planned
