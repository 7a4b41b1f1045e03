"""``edgepack serve --http`` with a language-model bundle, driven by the real ``openai``
client: chat and text completions (whole and streamed), the model list, stop strings,
limits and errors, continuous batching (16 concurrent streams give the tokens of 16
sequential ones), a client that leaves mid-stream, a full queue, SIGTERM.

The model is a random-weight Llama from transformers with a word-level tokenizer and a
chat template; greedy answers are checked against transformers' own ``generate``.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import mqtt_broker as mb
import pytest
from test_http import _serve

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.http

KEY = "sk-test-edgepack"
WORDS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"] + [f"w{i}" for i in range(59)]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CTX = 96
SLOTS = 16


def _llama_folder(d):
    from model_sources import word_llama

    model, tok = word_llama(d / "hf", WORDS, TEMPLATE, CTX)
    return model, tok, d / "hf"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from edgepack.packager.llm.build import build_llm

    d = tmp_path_factory.mktemp("openai")
    model, tok, hf = _llama_folder(d)
    bundle = d / "tiny.epk"
    build_llm(hf, bundle, ctx=CTX, chunk=8, kv="f32", slots=SLOTS, log=lambda s: None)
    try:
        # --batch-invariant: every decode step on the 16-row graph, so concurrent and
        # sequential requests give the same tokens to the last bit (the default, the
        # smallest graph that holds the step, rounds differently between row counts)
        s, url = _serve(bundle, d, "llm", "--model", "tiny", "--api-key", KEY,
                        "--queue", "32", "--batch-invariant")  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        yield SimpleNamespace(dir=d, bundle=bundle, model=model, tok=tok, server=s, url=url,
                              client=client)  # fmt: skip
    finally:
        mb.cleanup()


def _greedy(env, ids: list[int], n: int) -> str:
    """transformers' greedy continuation of ``ids``, as text (end of sequence dropped)."""
    with torch.no_grad():
        out = env.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=1, pad_token_id=1)[0, len(ids):].tolist()  # fmt: skip
    return env.tok.decode([t for t in out if t != 1])


def _chat_ids(env, messages) -> list[int]:
    text = "<s>" + "".join(f"<|{m['role']}|> {m['content']} " for m in messages) + "<|assistant|>"
    return env.tok.encode(text, add_special_tokens=False).ids


def test_models_list(env):
    assert [m.id for m in env.client.models.list().data] == ["tiny"]


def test_chat_completion_is_transformers_greedy(env):
    msgs = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w10 w11 w12"}]
    r = env.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                           temperature=0)  # fmt: skip
    ids = _chat_ids(env, msgs)
    assert r.choices[0].message.content == _greedy(env, ids, 12)
    assert r.choices[0].message.role == "assistant" and r.model == "tiny"
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_the_whole_answer(env):
    msgs = [{"role": "user", "content": "w30 w31"}]
    whole = env.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                               temperature=0)  # fmt: skip
    chunks = list(env.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_text_completion_by_text_and_by_token_ids(env):
    ids = env.tok.encode("w7 w8 w9", add_special_tokens=False).ids
    by_text = env.client.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=9,
                                            temperature=0)  # fmt: skip
    by_ids = env.client.completions.create(model="tiny", prompt=ids, max_tokens=9,
                                           temperature=0)  # fmt: skip
    assert by_text.choices[0].text == by_ids.choices[0].text == _greedy(env, ids, 9)
    assert by_ids.usage.prompt_tokens == len(ids)


def test_max_tokens_and_stop_strings(env):
    r = env.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=40,
                                      temperature=0)  # fmt: skip
    words = r.choices[0].text.split()
    if len(words) >= 3:
        stop = " ".join(words[1:3])
        s = env.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=40,
                                          temperature=0, stop=[stop])  # fmt: skip
        assert s.choices[0].text == r.choices[0].text[: r.choices[0].text.index(stop)]
        assert s.choices[0].finish_reason == "stop"
    # a sampled answer that cannot stop early: penalties on, min_p 0
    n = env.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5,
                                      temperature=1.5, seed=3, frequency_penalty=1.0,
                                      extra_body={"top_k": 40})  # fmt: skip
    assert n.usage.completion_tokens <= 5


def test_seeded_sampling_repeats(env):
    kw = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 16, "temperature": 0.9,
          "top_p": 0.95, "seed": 7}  # fmt: skip
    a, b = env.client.completions.create(**kw), env.client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def _one(env, i: int, stream: bool) -> str:
    sampling = {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i}
    # 40 tokens each (end of sequence banned), so the concurrent answers overlap
    kw = {"model": "tiny", "messages": [{"role": "user", "content": f"w{i} w{i + 1} w{2 * i}"}],
          "max_tokens": 40, "logit_bias": {"1": -100}, **sampling}  # fmt: skip
    if not stream:
        return env.client.chat.completions.create(**kw).choices[0].message.content
    parts = env.client.chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def test_16_concurrent_streams_give_the_tokens_of_16_sequential_ones(env):
    alone = [_one(env, i, stream=False) for i in range(16)]
    steps0 = _metric(env, "edgepack_decode_steps_total")
    rows0 = _metric(env, "edgepack_decode_rows_total")
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: _one(env, i, stream=True), range(16)))
    assert together == alone
    steps = _metric(env, "edgepack_decode_steps_total") - steps0
    rows = _metric(env, "edgepack_decode_rows_total") - rows0
    # decode steps ran several sequences at once (how many depends on how the client
    # threads are scheduled on a busy machine: 1.5 to 3 on average was seen)
    assert rows > steps


def test_a_chats_next_turn_reuses_the_cached_prompt(env):
    # the second turn starts with the first turn's prompt: the server keeps the keys
    # and values its slot holds (batch-invariant serving: the prompt tokens but the
    # last) and feeds only the rest; the answer is still transformers' greedy one
    msgs = [{"role": "user", "content": "w40 w41 w42 w43"}]
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0, "logit_bias": {"1": -100}}
    first = env.client.chat.completions.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "w44 w45"}]  # fmt: skip
    cached0 = _metric(env, 'edgepack_tokens_total{kind="prompt_cached"}')
    second = env.client.chat.completions.create(messages=msgs, **kw)
    ids = _chat_ids(env, msgs)
    assert second.choices[0].message.content == _greedy(env, ids, 6)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens - 1
    assert _metric(env, 'edgepack_tokens_total{kind="prompt_cached"}') - cached0 == cached


def test_the_prompt_cache_keeps_a_sequences_own_tokens_and_shares_prompts(env):
    # default serving keeps every position a sequence fed, its own tokens too: a next
    # turn that quotes the answer reuses all of it but the last token (sampled, never
    # fed). Prompts that arrive together with one start compute it once: the others
    # copy it from the first one's slot. Every answer is transformers' over the prompt.
    from edgepack.runtime.sampling import Sampler
    from edgepack.runtime.serve.generation import GenSequence
    from edgepack.runtime.serve.service import LLMService, ServiceConfig

    def want(prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = env.model(torch.tensor([seq])).logits[0, -1]
                logits[1] = -float("inf")  # the end of sequence, banned as below
                seq.append(int(logits.argmax()))
        return seq[len(prompt) :]

    svc = LLMService(env.bundle, "tiny", ServiceConfig(threads=1))
    try:

        def submit(prompt: list[int]) -> tuple[GenSequence, cf.Future]:
            done: cf.Future = cf.Future()
            seq = GenSequence("t", prompt, 5, Sampler(temperature=0, logit_bias={1: -100}),
                              lambda kind, data: kind in ("done", "error")
                              and done.set_result(data))  # fmt: skip
            svc.engine.submit(seq)
            return seq, done

        def answer(seq: GenSequence, done: cf.Future) -> tuple[list[int], int]:
            data = done.result(timeout=60)
            assert "usage" in data, data
            return seq.seen[len(seq.prompt) :], data["usage"]["prompt_tokens_details"][
                "cached_tokens"]  # fmt: skip

        p1 = [0, 2, 20, 21, 22, 3]
        out1, _ = answer(*submit(p1))
        p2 = p1 + out1 + [2, 30, 3]
        out2, cached = answer(*submit(p2))
        assert cached == len(p1) + 4 and out2 == want(p2, 5)
        base = [0, 2, 40, 41, 42, 43, 44]
        prompts = [base + [50 + i, 3] for i in range(3)]
        got = [answer(*j) for j in [submit(p) for p in prompts]]
        # the first one finds [0, 2] in a free slot; the others share its 7 tokens
        assert [c for _, c in got] == [2, 7, 7]
        assert [o for o, _ in got] == [want(p, 5) for p in prompts]
        # two prompts with a new start taking turns: b finds that start only in a's
        # free slot and copies it into an empty one, which leaves a's slot its whole
        # cache, so a again finds all of its prompt but the last token (taking the
        # slot cut a's cache off at the shared start: 5)
        start = [0, 2, 33, 34, 35]
        a, b = start + [36, 3], start + [37, 3]
        got = [answer(*submit(p)) for p in (a, b, a)]
        assert [c for _, c in got] == [2, len(start), len(a) - 1]
        assert [o for o, _ in got] == [want(p, 5) for p in (a, b, a)]
    finally:
        svc.close()


def _metric(env, name: str) -> float:
    """A sample of ``env.url``'s /metrics (an unlabelled name, or name{labels})."""
    text = httpx.get(f"{env.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_client_that_leaves_mid_stream_frees_its_slot(env, tmp_path):
    # a long context and the end-of-sequence token banned (logit_bias): the answer
    # would run 4000 tokens, the client reads one piece and goes
    from edgepack.packager.llm.build import build_llm

    long = tmp_path / "long.epk"
    build_llm(env.dir / "hf", long, ctx=4096, chunk=8, kv="f32", slots=2, log=lambda s: None)
    s, url = _serve(long, env.dir, "llm-long", "--model", "long")
    body = {"model": "long", "prompt": [3, 4], "max_tokens": 4000, "temperature": 1.0,
            "seed": 1, "stream": True, "logit_bias": {"1": -100}}  # fmt: skip
    metric = lambda name: _metric(SimpleNamespace(url=url), name)  # noqa: E731
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(x for x in r.iter_lines() if x.startswith("data:"))
        # the answer takes 1.2 s unhindered: the slot is freed long before it ends
        end = time.monotonic() + 10
        while metric("edgepack_kv_slots_in_use") > 0:
            assert time.monotonic() < end, "the slot stayed in use"
            time.sleep(0.02)
        assert metric('edgepack_errors_total{code="cancelled"}') == 1
        assert metric('edgepack_tokens_total{kind="generated"}') < 4000
    finally:
        assert s.terminate(timeout=60) == 0


@pytest.mark.parametrize(
    "kw, status, code",
    [
        ({"n": 2}, 400, None),
        ({"temperature": 3}, 400, None),
        ({"messages": []}, 400, None),
        ({"messages": [{"role": "user", "content": "w1 " * CTX}]}, 400, "context_length_exceeded"),
        ({"max_tokens": 10**6}, 400, "invalid_job"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ],
)  # fmt: skip
def test_bad_requests_are_400_in_openai_shape(env, kw, status, code):
    args = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        env.client.chat.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body
    assert err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    assert env.client.models.list().data  # still serving


def test_requests_without_the_key_are_refused(env):
    bad = openai.OpenAI(base_url=f"{env.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{env.url}/v1/completions", json={"model": "tiny", "prompt": "w1"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{env.url}/health").status_code == 200


def test_metrics_of_generation(env):
    env.client.completions.create(model="tiny", prompt="w2", max_tokens=3, temperature=0)
    assert _metric(env, 'edgepack_tokens_total{kind="generated"}') >= 3
    assert _metric(env, "edgepack_kv_slots") == SLOTS
    text = httpx.get(f"{env.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'edgepack_time_to_first_token_seconds_count{front="http"}' in text


def test_full_queue_is_429_and_sigterm_drains(env):
    # one slot and one waiting place: of four concurrent requests some are refused
    s, url = _serve(env.bundle, env.dir, "llm-small", "--slots", "1", "--queue", "1",
                    "--no-prompt-cache")  # fmt: skip
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = {"model": "x", "prompt": [3, 4], "max_tokens": 60, "temperature": 1.0, "seed": 2}
    # without the prompt cache a repeated prompt is computed again
    again = [c.completions.create(**(kw | {"max_tokens": 2})) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in again] == [0, 0]

    start = threading.Barrier(4)  # all four at once: sent one by one, a fast machine
    # finished each before the next arrived and refused none (CI rehearsal, stop 36)

    def one(_):
        start.wait(timeout=60)
        try:
            return c.completions.create(**kw).choices[0].finish_reason
        except openai.RateLimitError as e:
            assert int(e.response.headers["Retry-After"]) >= 1
            return 429

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    assert 429 in got and any(g != 429 for g in got), got
    # SIGTERM while a stream runs: it finishes, then the server exits 0
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: list(c.completions.create(**kw, stream=True)))
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        chunks = fut.result(timeout=60)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert s.proc.wait(timeout=60) == 0
