"""Text generation on an LLM bundle: the tokenizer and chat template the bundle carries,
the sampler, stop strings and streaming, end to end through the bundle."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import cli_env
from edgepack.packager.llm.build import build_llm
from edgepack.runtime.generate import Stats, generate
from edgepack.runtime.llm import LLMSession
from edgepack.runtime.sampling import Sampler
from edgepack.runtime.text import TextCodec, TextError
from model_sources import word_llama

pytestmark = pytest.mark.cpu

WORDS = ["<s>", "</s>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(60)]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    hf = d / "hf"
    model, _ = word_llama(hf, WORDS, TEMPLATE, 64)
    build_llm(hf, d / "t.epk", ctx=48, chunk=4, kv="f32", log=lambda s: None)
    return model, d / "t.epk"


def _session(path):
    s = LLMSession(path)
    return s, TextCodec(s.bundle.manifest, s.bundle.weights)


def test_greedy_text_is_transformers_greedy(bundle):
    model, path = bundle
    s, codec = _session(path)
    prompt = "w3 w17 w5 w40"
    ids = codec.encode(prompt)
    st = Stats()
    text = "".join(generate(s, codec, prompt, max_tokens=12, stats=st))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             eos_token_id=1, pad_token_id=1)[0, len(ids):].tolist()  # fmt: skip
    want = [t for t in out if t != 1]
    assert text == codec.decode(want)
    assert st.prompt_tokens == len(ids) and st.decode_tokens == len(out)
    assert st.prompt_tps > 0 and st.decode_tps > 0


def test_chat_template_and_stop_strings(bundle):
    _, path = bundle
    s, codec = _session(path)
    prompt = codec.chat([{"role": "user", "content": "w1 w2"}])
    assert prompt == "<s><|user|> w1 w2 <|assistant|>"
    full = "".join(generate(s, codec, prompt, max_tokens=10))
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    st = Stats()
    cut = "".join(generate(s, codec, prompt, max_tokens=10, stop=[stop], stats=st))
    assert st.stop == "stop string" and stop not in cut and full.startswith(cut)
    plain = TextCodec({"llm": {}}, s.bundle.weights)  # a model folder without a template
    with pytest.raises(TextError, match="no chat template"):
        plain.chat([{"role": "user", "content": "w1"}])


def test_sampling_is_seeded_and_filters_as_documented():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    s1, s2 = Sampler(temperature=0.8, seed=7), Sampler(temperature=0.8, seed=7)
    draws = [s1(logits) for _ in range(20)]
    assert draws == [s2(logits) for _ in range(20)] and len(set(draws)) > 1
    p = Sampler(temperature=1.0, top_k=5).probabilities(logits)
    assert np.count_nonzero(p) == 5 and set(np.flatnonzero(p)) == set(np.argsort(logits)[-5:])
    full = Sampler(temperature=1.0).probabilities(logits)
    p = Sampler(temperature=1.0, top_p=0.5).probabilities(logits)
    kept = np.flatnonzero(p)
    order = np.argsort(-full)
    n = len(kept)
    assert set(kept) == set(order[:n])  # the most likely tokens
    assert full[order[: n - 1]].sum() < 0.5 <= full[order[:n]].sum()  # the fewest reaching p
    p = Sampler(temperature=1.0, min_p=0.2).probabilities(logits)
    assert np.all(full[p > 0] >= 0.2 * full.max()) and np.all(full[p == 0] < 0.2 * full.max())
    seen = [int(np.argmax(logits))]
    pen = Sampler(temperature=0.0, repetition_penalty=1e6)
    assert pen(logits, seen) != seen[0]  # the repeated token is pushed down
    assert Sampler()(logits) == int(np.argmax(logits))
    with pytest.raises(ValueError):
        Sampler(top_p=0.0)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepack.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=600, env=cli_env())  # fmt: skip


def test_cli_build_info_generate(bundle, tmp_path):
    # llama.cpp's habits: build a folder, then generate streams text to stdout and the
    # speeds to stderr; info names the architecture, context and KV cache
    _, path = bundle
    out = tmp_path / "cli.epk"
    r = _cli("build", path.parent / "hf", "-o", out, "--ctx", "32", "--chunk", "8")
    assert r.returncode == 0, r.stderr
    assert "KV cache" in r.stdout
    r = _cli("info", out)
    assert r.returncode == 0, r.stderr
    assert "llm:      llama, 2 layers, width 32" in r.stdout
    assert "context:  32 positions x 1 slot(s)" in r.stdout and "(f16)" in r.stdout
    r = _cli("generate", out, "-p", "w1 w2", "--chat", "-n", "6", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and all(w in WORDS for w in r.stdout.split()), r.stdout
    assert "prompt: " in r.stderr and "tok/s" in r.stderr
    r = _cli("generate", out, "-p", " ".join(["w1"] * 40))
    assert r.returncode == 1 and "exceed the context of 32" in r.stderr
    # a quantized build measures itself on the shipped text (the model's own tokenizer)
    q8 = tmp_path / "q8.epk"
    r = _cli("build", path.parent / "hf", "-o", q8, "--ctx", "32", "--quant", "int8",
             "--max-error", "1.0")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "measure the error against fp32 on the shipped text" in r.stdout
    r = _cli("info", q8)
    assert r.returncode == 0 and "mean KL" in r.stdout and "perplexity" in r.stdout, r.stdout
    # bench in llama-bench's terms; depths past the context are left out
    r = _cli("bench", out, "--pp", "12", "--tg", "8", "--depth", "0", "16", "30", "-r", "2")
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0] + (ln.split()[2] if "@" in ln else ""): ln
             for ln in r.stdout.splitlines()[2:]}  # fmt: skip
    assert set(lines) == {"pp12", "tg8", "tg8d16"}, r.stdout
    assert all(float(ln.split()[-1]) > 0 for k, ln in lines.items() if k.startswith("tg"))
    r = _cli("bench", out, "--profile", "--depth", "5", "-r", "1")
    assert r.returncode == 0, r.stderr
    assert "decode step at depth 5:" in r.stdout and "prompt chunk of 8 tokens" in r.stdout
    assert "attention/f32" in r.stdout and "lm_head" in r.stdout


def test_a_runtime_without_the_text_packages_says_what_to_install(bundle, monkeypatch):
    _, path = bundle
    s = LLMSession(path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(TextError, match=r"lacks the tokenizers package.*edgepack\[llm\]"):
        TextCodec(s.bundle.manifest, s.bundle.weights)
