"""Token streams over MQTT (docs/protocol.md, "Generation jobs"): a language-model
bundle served by ``edgepack serve --broker``, read by a plain paho client. Streamed
and whole answers equal transformers' greedy text; re-sending a job id replays the
stream; cancel and deadlines end a running generation; bad jobs get errors."""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from types import SimpleNamespace

import mqtt_broker as mb
import pytest
from test_openai_api import _greedy, _llama_folder

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        not mb.have_mosquitto(), reason="needs mosquitto (apt-get install mosquitto)"
    ),
]


class Caller:
    """A plain paho v5 client: publishes jobs with a Response Topic and collects the
    messages of each job id."""

    def __init__(self, url: str) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._props = lambda: Properties(PacketTypes.PUBLISH)
        self.me = f"caller-{uuid.uuid4().hex[:8]}"
        self.topic = f"edgepack/v1/reply/{self.me}"
        self.got: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.c = mb.mqtt_client(url, self.me)
        self.c.on_message = self._on_message
        done = threading.Event()
        self.c.on_subscribe = lambda *a: done.set()
        self.c.subscribe(self.topic, qos=1)
        assert done.wait(10)

    def _on_message(self, client, userdata, msg) -> None:
        m = json.loads(msg.payload)
        with self.lock:
            self.got.setdefault(m["id"], queue.Queue()).put(m)

    def send(self, topic: str, body: dict) -> None:
        props = self._props()
        props.ResponseTopic = self.topic
        props.CorrelationData = body["id"].encode()
        props.ContentType = "application/json"
        with self.lock:
            self.got.setdefault(body["id"], queue.Queue())
        self.c.publish(topic, json.dumps(body), qos=1, properties=props).wait_for_publish(10)

    def until_final(self, job_id: str, timeout: float = 60.0) -> list[dict]:
        out, end = [], time.monotonic() + timeout
        while True:
            m = self.got[job_id].get(timeout=max(0.1, end - time.monotonic()))
            out.append(m)
            if m.get("final"):
                return out

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from edgepack.packager.llm.build import build_llm

    d = tmp_path_factory.mktemp("mqtt-gen")
    model, tok, hf = _llama_folder(d)
    small, long = d / "tiny.epk", d / "long.epk"
    build_llm(hf, small, ctx=96, chunk=8, kv="f32", slots=4, log=lambda s: None)
    build_llm(hf, long, ctx=4096, chunk=8, kv="f32", slots=2, log=lambda s: None)
    broker = mb.Broker(d / "broker").start()
    watcher = mb.StatusWatcher(broker.url)
    try:
        agents = {"gen": mb.Agent(small, broker.url, "gen", "--model", "tiny", logdir=d),
                  "gen-long": mb.Agent(long, broker.url, "gen-long", "--no-fleet",
                                       logdir=d)}  # fmt: skip
        for name, a in agents.items():
            watcher.wait(name, "online", agent=a)
        caller = Caller(broker.url)
        yield SimpleNamespace(model=model, tok=tok, broker=broker, watcher=watcher,
                              agents=agents, caller=caller, dir=d)  # fmt: skip
        caller.close()
    finally:
        watcher.close()
        mb.cleanup()


FLEET = "edgepack/v1/model/tiny/jobs"


def test_a_streamed_generation_read_by_a_plain_paho_client(env):
    ids = [5, 6, 7, 8]
    env.caller.send(FLEET, {"v": 1, "id": "g-stream", "stream": True, "generate": {
        "prompt": ids, "max_tokens": 20, "temperature": 0}})  # fmt: skip
    msgs = env.caller.until_final("g-stream")
    parts, final = msgs[:-1], msgs[-1]
    assert final["status"] == "ok" and final["parts"] == len(parts)
    assert [p["seq"] for p in parts] == list(range(len(parts)))
    for a, b in zip(parts, parts[1:]):  # rows: consecutive token ranges
        assert a["rows"][1] == b["rows"][0]
    assert "".join(p["text"] for p in parts) == _greedy(env, ids, 20)
    assert final["usage"]["prompt_tokens"] == len(ids)
    assert final["finish_reason"] in ("stop", "length") and final["device"] == "gen"
    # the status says what the agent serves
    st = env.watcher.status["gen"]
    assert st["generate"]["ctx"] == 96 and st["generate"]["slots"] == 4


def test_whole_answers_and_chat(env):
    env.caller.send(FLEET, {"v": 1, "id": "g-whole", "generate": {
        "prompt": [9, 10], "max_tokens": 15, "temperature": 0}})  # fmt: skip
    (final,) = env.caller.until_final("g-whole")
    assert final["status"] == "ok" and final["text"] == _greedy(env, [9, 10], 15)
    msgs = [{"role": "user", "content": "w1 w2"}]
    env.caller.send(FLEET, {"v": 1, "id": "g-chat", "generate": {
        "messages": msgs, "max_tokens": 10, "temperature": 0}})  # fmt: skip
    (final,) = env.caller.until_final("g-chat")
    chat_ids = env.tok.encode("<s><|user|> w1 w2 <|assistant|>", add_special_tokens=False).ids
    assert final["text"] == _greedy(env, chat_ids, 10)


def test_resending_the_job_id_replays_the_stream(env):
    body = {"v": 1, "id": "g-replay", "stream": True,
            "generate": {"prompt": [11, 12], "max_tokens": 12, "temperature": 0}}  # fmt: skip
    env.caller.send(FLEET, body)
    first = env.caller.until_final("g-replay")
    env.caller.send("edgepack/v1/dev/gen/jobs", body)
    again = env.caller.until_final("g-replay")
    assert all(m.get("dup") for m in again)
    assert [m["text"] for m in again[:-1]] == [m["text"] for m in first[:-1]]


def test_cancel_ends_a_running_generation(env):
    jid = "g-cancel"
    env.caller.send("edgepack/v1/dev/gen-long/jobs", {"v": 1, "id": jid, "stream": True,
                    "generate": {"prompt": [3, 4], "max_tokens": 4000, "temperature": 1.0,
                                 "seed": 1, "logit_bias": {"1": -100}}})  # fmt: skip
    # The cancel goes to the device that runs the job (named in every message), right
    # behind the job on the same topic: QoS 1 keeps their order, and the agent admits
    # a generation before it reads the next message, so the cancel always finds it
    # running. Waiting for a first partial message raced the whole generation: the
    # tiny model makes its 4000 tokens in about a second, and a loaded CI box delayed
    # the test's cancel past that.
    env.caller.send("edgepack/v1/dev/gen-long/jobs", {"v": 1, "id": jid, "cancel": True})
    msgs = env.caller.until_final(jid)
    final = msgs[-1]
    assert final["status"] == "error" and final["error"]["code"] == "cancelled"
    assert final["device"] == "gen-long"
    assert all(m["status"] == "partial" and m["rows"][1] < 4000 for m in msgs[:-1])


def test_deadline_ends_a_generation(env):
    jid = "g-deadline"
    env.caller.send("edgepack/v1/dev/gen-long/jobs", {"v": 1, "id": jid, "timeout_ms": 150,
                    "generate": {"prompt": [3, 4], "max_tokens": 4000, "temperature": 1.0,
                                 "seed": 2, "logit_bias": {"1": -100}}})  # fmt: skip
    (final,) = env.caller.until_final(jid)
    assert final["status"] == "error" and final["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize("generate, code", [
    ({"prompt": [1], "temperature": 5}, "invalid_job"),
    ({"prompt": []}, "invalid_job"),
    ({"prompt": [1], "max_tokens": 10**6}, "invalid_job"),
    ({"messages": [{"role": "user", "content": "w1 " * 100}]}, "context_length_exceeded"),
    ({"prompt": [99999]}, "invalid_job"),
])  # fmt: skip
def test_bad_generation_jobs_get_errors(env, generate, code):
    jid = f"g-bad-{uuid.uuid4().hex[:6]}"
    env.caller.send(FLEET, {"v": 1, "id": jid, "generate": generate})
    (final,) = env.caller.until_final(jid)
    assert final["status"] == "error" and final["error"]["code"] == code, final


def test_a_tensor_job_to_a_language_model_is_unsupported(env):
    env.caller.send(FLEET, {"v": 1, "id": "g-tensor", "inputs": {"x": [1.0]}})
    (final,) = env.caller.until_final("g-tensor")
    assert final["error"]["code"] == "unsupported"
    assert "generate" in final["error"]["message"]
