"""GGUF architectures and tokenizers beyond Llama with GPT-2's byte-level BPE: tiny Qwen2
and Qwen3 GGUFs written by this test (gguf's GGUFWriter, the tensor names and keys
llama.cpp's convert_hf_to_gguf.py writes), packed fp32 by edgepack and loaded by
transformers from the same file (``gguf_file=``): the logits agree. Qwen's q/k rows
are not permuted in a GGUF (NEOX RoPE), Llama's are; a Qwen3 head is wider than
hidden / heads, so its size must come from ``qwen3.attention.key_length``.

Tokenizers: byte-level BPE with the Qwen2, Llama 3, Smaug and Tekken pre-tokenizers,
and a SentencePiece vocabulary (``tokenizer.ggml.model`` llama: pieces with scores, byte
tokens, control tokens), rebuilt by edgepack, give the ids and text transformers' GGUF
tokenizer gives (for SentencePiece, up to the "▁" llama.cpp puts before a leading space,
which transformers leaves out).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from edgepack.packager.ir import PackError
from edgepack.packager.llm.build import build_llm
from edgepack.packager.llm.gguf_file import load_gguf
from edgepack.runtime.llm import LLMSession

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.cpu

SPACE = "\u2581"
TEXTS = [
    "hello world",
    " leading space",
    "two  spaces and trailing ",
    "12345 and 67 in 2024",
    "line\nbreak\n\n  indented",
    "héllo wörld 世界",
    "don't I'll WE'RE they've",
    "tabs\tand emoji 🙂!",
    "unknown ẞ§ chars",
]
CORPUS = [
    "hello world, hello there",
    "12345 and 67 and 2024 in 12345",
    "don't I'll WE'RE they've",
    "héllo wörld\n\n  indented",
]


def _trained(byte_level: bool, size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a BPE trained on CORPUS by the tokenizers library (a
    vocabulary whose merges reach every token): byte-level after GPT-2's split, or on
    SentencePiece's "▁" spelling."""
    pre = tokenizers.pre_tokenizers
    t = tokenizers.Tokenizer(tokenizers.models.BPE())
    t.pre_tokenizer = pre.ByteLevel(add_prefix_space=False) if byte_level else pre.Metaspace()
    alphabet = pre.ByteLevel.alphabet() if byte_level else []
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=size, initial_alphabet=alphabet,
                                             show_progress=False)  # fmt: skip
    t.train_from_iterator(CORPUS * 10, trainer)
    model = json.loads(t.to_str())["model"]
    tokens = [k for k, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [" ".join(m) for m in model["merges"]]


def _bpe_vocab(pre: str, add_bos: bool) -> dict:
    tokens, merges = _trained(True, 400)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    return dict(model="gpt2", pre=pre, tokens=tokens + special, merges=merges,
                types=[1] * len(tokens) + [3, 3, 3, 4], bos=len(tokens), eos=len(tokens) + 2,
                add_bos=add_bos)  # fmt: skip


def _spm_vocab() -> dict:
    """A SentencePiece-style vocabulary as llama.cpp's converter writes Llama 2's: <unk>,
    <s>, </s>, the 256 byte tokens, then pieces ("▁" for spaces) scored best merge first.
    Characters outside the corpus (世, 🙂, ẞ...) have no piece and fall back to bytes."""
    pieces, _ = _trained(False, 200)
    pieces = [p for p in pieces if p not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return dict(model="llama", tokens=tokens, scores=scores,
                types=[2, 3, 3] + [6] * 256 + [1] * len(pieces), bos=1, eos=2, unk=0)  # fmt: skip


def _write_gguf(path, arch: str, vocab: dict, *, head_dim=None, dtype=np.float32, tied=False,
                layers=2, hidden=128, ffn=256, heads=4, kv=2, seed=0, theta=1e6, keys=None,
                tensors=None) -> None:  # fmt: skip
    """A tiny decoder of ``arch`` as llama.cpp writes one: Qwen2 with q/k/v biases, Qwen3
    with q/k RMSNorm weights and ``attention.key_length``, Gemma 3 with those norms and
    its post-attention and post-MLP ones (stored 1 + w, as the converter adds 1), random
    weights as ``dtype``, but ``tensors`` (GGUF name -> array) as given. ``keys``: more
    keys, as GGUFWriter method -> value."""
    rng = np.random.default_rng(seed)
    hd = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    for method, value in (keys or {}).items():
        getattr(w, method)(value)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(hd)
    if head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    if "add_bos" in vocab:
        w.add_add_bos_token(vocab["add_bos"])
    n = len(vocab["tokens"])
    mats = {"token_embd.weight": (n, hidden)} | ({} if tied else {"output.weight": (n, hidden)})
    vecs = {"output_norm.weight": hidden}
    for i in range(layers):
        b = f"blk.{i}."
        shapes = {
            "attn_q": (heads * hd, hidden),
            "attn_k": (kv * hd, hidden),
            "attn_v": (kv * hd, hidden),
            "attn_output": (hidden, heads * hd),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }
        mats |= {f"{b}{k}.weight": v for k, v in shapes.items()}  # fmt: skip
        vecs |= {b + "attn_norm.weight": hidden, b + "ffn_norm.weight": hidden}
        if arch == "qwen2":
            vecs |= {b + "attn_q.bias": heads * hd, b + "attn_k.bias": kv * hd,
                     b + "attn_v.bias": kv * hd}  # fmt: skip
        if arch in ("qwen3", "gemma3"):
            vecs |= {b + "attn_q_norm.weight": hd, b + "attn_k_norm.weight": hd}
        if arch == "gemma3":
            vecs |= {b + "post_attention_norm.weight": hidden, b + "post_ffw_norm.weight": hidden}
    out = {name: (rng.standard_normal(shape) * 0.08).astype(dtype) for name, shape in mats.items()}
    for name, size in vecs.items():
        v = rng.uniform(-0.5, 0.5, size) if name.endswith("bias") else rng.uniform(0.5, 1.5, size)
        out[name] = v.astype(np.float32)
    out |= {name: np.ascontiguousarray(t, np.float32) for name, t in (tensors or {}).items()}
    for name, t in out.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


QWEN = {  # arch -> writer options: F16 matrices and an output projection; F32 and tied
    "qwen2": dict(dtype=np.float16),
    "qwen3": dict(head_dim=128, tied=True),  # hidden / heads is 32
}


@pytest.mark.parametrize("arch", list(QWEN))
def test_qwen_gguf_logits_are_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(src, arch, _bpe_vocab("qwen2", add_bos=False), **QWEN[arch])
    build_llm(src, tmp_path / "t.epk", quant="fp32", ctx=32, chunk=8, kv="f32",
              log=lambda s: None)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    assert model.config.model_type == arch
    ids = [5, 300, 17, 99, 3, 256, 42, 7, 150, 11]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    s = LLMSession(tmp_path / "t.epk")
    got = [s.prefill(ids[:6]).copy()] + [s.step(t).copy() for t in ids[6:]]
    scale = float(np.abs(want).max())
    for k, g in zip([5, 6, 7, 8, 9], got):
        np.testing.assert_allclose(g, want[k], rtol=1e-4, atol=1e-4 * scale, err_msg=f"{k}")


def _edgepack_logits(src, tmp_path, ids: list[int], prompt: int) -> list[np.ndarray]:
    """edgepack's logits of ``src`` packed fp32: the prompt's last, then each decode step's."""
    build_llm(src, tmp_path / "t.epk", quant="fp32", ctx=32, chunk=8, kv="f32",
              log=lambda s: None)  # fmt: skip
    s = LLMSession(tmp_path / "t.epk")
    return [s.prefill(ids[:prompt]).copy()] + [s.step(t).copy() for t in ids[prompt:]]


def _agree(got: list[np.ndarray], want: np.ndarray, first: int) -> None:
    scale = float(np.abs(want).max())
    for k, g in enumerate(got, first):
        np.testing.assert_allclose(g, want[k], rtol=1e-4, atol=1e-4 * scale, err_msg=f"{k}")


# 20 of prompt, then 5 decode steps
IDS = [5, 300, 17, 99, 3, 256, 42, 7, 150, 11, 64, 201, 33, 8, 120, 77, 250, 19, 90, 140,
       12, 230, 55, 180, 2]  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def _converter_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (conversion/llama.py), as written there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))  # fmt: skip


def _converter_rope_freqs(p: dict, dim: int) -> np.ndarray:
    """The rope_freqs tensor of LlamaModel.generate_extra_tensors (conversion/llama.py),
    as written there: the factor each rotated pair's frequency is divided by."""
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def test_llama31_rope_freqs_give_the_hf_model(tmp_path):
    """A Llama 3.1 GGUF: llama3 RoPE scaling arrives as a rope_freqs tensor of frequency
    factors. A random HF Llama whose scaling starts at 32 positions (so it acts at the
    test's) is written as the converter writes it (q/k permuted, rope_freqs computed as
    it computes them); edgepack's logits from the file are the HF model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = _bpe_vocab("llama-bpe", add_bos=True)
    layers, hidden, heads, kv = 2, 64, 4, 2
    cfg = LlamaConfig(vocab_size=len(vocab["tokens"]), hidden_size=hidden, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=256, rms_norm_eps=1e-6,
                      initializer_range=0.25, tie_word_embeddings=False,
                      rope_parameters=dict(LLAMA3_ROPE))  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors = {}
    for name, p in model.state_dict().items():
        w = p.numpy()
        if name.endswith("q_proj.weight"):
            w = _converter_permute(w, heads, heads)
        elif name.endswith("k_proj.weight"):
            w = _converter_permute(w, heads, kv)
        tensors[names.get_name(name, try_suffixes=(".weight",))] = w
    tensors["rope_freqs.weight"] = _converter_rope_freqs(LLAMA3_ROPE, hidden // heads)
    src = tmp_path / "llama31.gguf"
    _write_gguf(src, "llama", vocab, layers=layers, hidden=hidden, ffn=96, heads=heads, kv=kv,
                theta=LLAMA3_ROPE["rope_theta"], tensors=tensors)  # fmt: skip
    assert load_gguf(src)[0]["rope_scaling"]["rope_type"] == "factors"
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
        plain = copy.deepcopy(cfg)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
        unscaled = LlamaForCausalLM(plain).eval()
        unscaled.load_state_dict(model.state_dict())
        other = unscaled(torch.tensor([IDS])).logits[0].numpy()
    assert np.abs(other[19:] - want[19:]).max() > 1e-2 * np.abs(want).max()  # scaling acts
    _agree(_edgepack_logits(src, tmp_path, IDS, 20), want, 19)


# case -> (writer options, GGUF keys, the HF config values llama.cpp reads the file as
# where transformers' GGUF loader reads nothing: query scale, layer pattern, local base,
# linear scaling). "default": 7 layers, every 6th full, window 4, heads of 256 (llama.cpp's
# query scale 1/sqrt(head size) is then transformers' default query_pre_attn_scalar).
GEMMA3 = {
    "default": (dict(head_dim=256, tied=True), {"add_sliding_window": 4}, {}),
    "scaled": (
        dict(head_dim=48),
        {"add_sliding_window": 4, "add_sliding_window_pattern": 3,
         "add_rope_freq_base_swa": 2e4, "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
         "add_rope_scaling_factor": 8.0},
        {"query_pre_attn_scalar": 48, "sliding_window_pattern": 3, "layer_types": None,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GEMMA3))
def test_gemma3_gguf_logits_are_transformers(tmp_path, case):
    """A tiny Gemma 3 GGUF (norms stored 1 + w, q/k norms, post norms, sliding layers,
    a SentencePiece vocabulary) against transformers loading the same file; where the
    file says more than that loader reads ("scaled"), its weights under the config
    llama.cpp reads."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    opts, keys, meant = GEMMA3[case]
    src = tmp_path / "gemma3.gguf"
    vocab = _spm_vocab()
    _write_gguf(src, "gemma3", vocab, layers=7, hidden=64, ffn=96, heads=2, kv=1,
                keys={"add_add_space_prefix": False, **keys}, **opts)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    assert model.config.model_type == "gemma3_text"
    if meant:
        ref = Gemma3ForCausalLM(Gemma3TextConfig(**{**model.config.to_dict(), **meant})).eval()
        ref.load_state_dict(model.state_dict())
        model = ref
    types = model.config.layer_types
    assert types.count("full_attention") == (1 if case == "default" else 2), types
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
    _agree(_edgepack_logits(src, tmp_path, IDS, 20), want, 19)


def test_gemma3_gguf_config_is_llama_cpps(tmp_path):
    """What llama.cpp makes of a Gemma 3 file's keys (src/models/gemma3.cpp): no sliding
    window, every layer full; a per-layer pattern array; its query scale 1/sqrt(hidden /
    heads) for the 62-layer model (27B), else 1/sqrt(head size)."""
    from edgepack.packager.llm.arch import decoder_spec

    vocab = _spm_vocab()
    cases = [
        (3, {}, (0, 0, 0), 48),
        (3, {"add_sliding_window": 5, "add_sliding_window_pattern": [True, False, True]},
         (5, 0, 5), 48),
        (62, {"add_sliding_window": 5}, tuple(0 if i % 6 == 5 else 5 for i in range(62)), 32),
    ]  # fmt: skip
    for i, (layers, keys, windows, scalar) in enumerate(cases):
        src = tmp_path / f"g{i}.gguf"
        _write_gguf(src, "gemma3", vocab, layers=layers, hidden=64, ffn=32, heads=2, kv=1,
                    head_dim=48, keys=keys)  # fmt: skip
        spec = decoder_spec(load_gguf(src)[0])
        assert spec.windows == windows and spec.attn_scale == scalar**-0.5, i
        assert spec.norm_offset == 1 and spec.rope_local_theta == 1e4


def _both(tmp_path, arch: str, vocab: dict):
    """(edgepack's tokenizer from load_gguf, transformers' from the same file)."""
    from transformers import AutoTokenizer

    src = tmp_path / "tok.gguf"
    _write_gguf(src, arch, vocab, layers=1, hidden=64, ffn=64)
    ours = tokenizers.Tokenizer.from_str(load_gguf(src)[2].decode("utf-8"))
    return ours, AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)


def _same(ours, theirs, texts) -> None:
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


# tokenizer.ggml.pre, the architecture it comes with, BOS added, longest run of digits
PRES = [("qwen2", "qwen2", False, 1), ("llama-bpe", "llama", True, 3),
        ("smaug-bpe", "llama", False, 3), ("tekken", "llama", True, 1)]  # fmt: skip


@pytest.mark.parametrize(("pre", "arch", "add_bos", "digits"), PRES, ids=[p[0] for p in PRES])
def test_byte_level_pre_tokenizers_are_transformers(tmp_path, pre, arch, add_bos, digits):
    ours, theirs = _both(tmp_path, arch, _bpe_vocab(pre, add_bos))
    _same(ours, theirs, TEXTS + ["<|im_start|>user\nhi<|im_end|>", "a<think>b"])
    # the split is the pre-tokenizer's: digits one by one (Qwen2, Tekken) or in runs of
    # up to three (Llama 3), though the merges (learnt after GPT-2's split) make "12345"
    # one token
    pieces = [ours.id_to_token(i) for i in ours.encode("12345", add_special_tokens=False).ids]
    assert ours.token_to_id("12345") is not None and "".join(pieces) == "12345"
    longest = max(map(len, pieces))
    assert longest <= digits and (longest > 1) == (digits > 1), pieces
    assert (ours.encode("x").ids[0] == ours.token_to_id("<|endoftext|>")) == add_bos


def test_sentencepiece_vocabulary_is_transformers(tmp_path):
    ours, theirs = _both(tmp_path, "llama", _spm_vocab())
    _same(ours, theirs, [t for t in TEXTS if not t[0].isspace()] + ["ends with </s>"])
    ids = ours.encode("hello world").ids
    assert [ours.id_to_token(i) for i in ids] == ["<s>", SPACE + "hello", SPACE + "world"]
    # a character with no piece goes out as its UTF-8 bytes
    pieces = [ours.id_to_token(i) for i in ours.encode("世", add_special_tokens=False).ids]
    assert pieces == [SPACE, "<0xE4>", "<0xB8>", "<0x96>"]
    # llama.cpp (llama-vocab.cpp, the SPM case of tokenize) puts one space in front of
    # the text, and after each special token, whatever follows, as SentencePiece's
    # dummy prefix and Llama 2's tokenizer.json normalizer do. transformers' Metaspace
    # (prepend_scheme "first") adds none to a text that starts with a space and none
    # after a special token, so those are compared with the space it leaves out.
    ids = ours.encode(" leading space").ids
    assert ids == theirs.encode("  leading space")
    assert ours.decode(ids, skip_special_tokens=True) == " leading space"
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    mid = ours.encode("hello</s>world", add_special_tokens=False).ids
    assert [ours.id_to_token(i) for i in mid] == [SPACE + "hello", "</s>", SPACE + "world"]
    assert mid == theirs.encode("hello</s> world", add_special_tokens=False)


def test_unknown_architecture_and_tokenizers_are_refused(tmp_path):
    cases = [
        ("mamba", _bpe_vocab("qwen2", False), "'mamba'"),
        ("llama", _bpe_vocab("qwen2", False) | {"model": "bert"}, "'bert'"),
        ("llama", _bpe_vocab("qwen2", False) | {"model": "t5"}, "'t5'"),
        ("llama", _bpe_vocab("deepseek-llm", False), "'deepseek-llm'"),
        ("llama", _bpe_vocab("qwen2", False), "'yarn'",
         {"keys": {"add_rope_scaling_type": gguf.RopeScalingType.YARN}}),
        ("qwen2", _bpe_vocab("qwen2", False), "'rope_freqs.weight'",
         {"tensors": {"rope_freqs.weight": np.ones(8)}}),
        ("llama", _bpe_vocab("qwen2", False), "5 factors for heads of 16",
         {"tensors": {"rope_freqs.weight": np.ones(5)}}),
        ("gemma3", _spm_vocab(), "final_logit_softcapping",
         {"keys": {"add_final_logit_softcapping": 30.0}}),
    ]  # fmt: skip
    for i, (arch, vocab, needle, *more) in enumerate(cases):
        src = tmp_path / f"bad{i}.gguf"
        _write_gguf(src, arch, vocab, layers=1, hidden=64, ffn=64, **(more[0] if more else {}))
        with pytest.raises(PackError, match=needle):
            load_gguf(src)
