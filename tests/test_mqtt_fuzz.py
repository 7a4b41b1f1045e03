"""1,000 malformed jobs against one agent through a real Mosquitto: bad JSON, wrong
dtypes and shapes, oversize payloads, missing fields, binary garbage, hostile headers.
Each gets exactly one error reply with the expected stable code (or, without a reply
address, one log line); the agent keeps serving and its memory stays flat."""

from __future__ import annotations

import base64
import json
import threading
import time

import mqtt_broker as mb
import numpy as np
import pytest
from conftest import load

pytestmark = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        not mb.have_mosquitto(), reason="needs mosquitto (apt-get install mosquitto)"
    ),
]

JOBS = "edgepack/v1/dev/fz/jobs"
REPLIES = "fuzz/replies"
LIMIT = 64 * 1024  # the agent's --max-job-bytes


def npy(descr: str, shape, body: bytes) -> bytes:
    h = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    h += b" " * (-(len(h) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + body


def fuzz_cases(n: int, seed: int, x: np.ndarray) -> list[dict]:
    """``n`` malformed jobs: payload, content type, user properties, whether it has a
    reply address, and the error code it must get."""
    rng = np.random.default_rng(seed)
    good = x.tolist()
    b64 = lambda a: base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()  # noqa: E731
    out = []
    for i in range(n):
        jid = f"fz-{seed}-{i}"
        kind = i % 16
        ct, user = "application/json", {"ep-id": jid}
        body: object = None
        if kind == 0:  # truncated JSON
            s = json.dumps({"id": jid, "inputs": {"image": good}})
            payload, code = s[: int(rng.integers(1, len(s) - 1))].encode(), "malformed"
        elif kind == 1:  # JSON that is not an object
            payload, code = json.dumps([1, 2, "x"][: i % 3 + 1]).encode(), "malformed"
        elif kind == 2:  # no id anywhere
            user, body, code = {}, {"inputs": {"image": good}}, "invalid_job"
        elif kind == 3:  # no inputs
            body, code = {"id": jid}, "invalid_job"
        elif kind == 4:  # wrong dtype
            dt = ["f64", "i32", "f16", "u8"][i % 4]
            t = {"dtype": dt, "shape": [1, 1, 8, 8], "b64": b64(x.astype(codec_dtype(dt)))}
            body, code = {"id": jid, "inputs": {"image": t}}, "bad_input"
        elif kind == 5:  # wrong shape
            shape = [[1, 8, 8], [1, 1, 8, 7], [1, 2, 8, 8], [64]][i % 4]
            t = {"dtype": "f32", "shape": shape, "data": [0.5] * int(np.prod(shape))}
            body, code = {"id": jid, "inputs": {"image": t}}, "bad_input"
        elif kind == 6:  # unknown or extra input names
            inputs = [{"img": good}, {"image": good, "extra": good}][i % 2]
            body, code = {"id": jid, "inputs": inputs}, "bad_input"
        elif kind == 7:  # over the agent's size limit
            body = {
                "id": jid,
                "inputs": {"image": good},
                "pad": "x" * (LIMIT + int(rng.integers(1, 5000))),
            }
            code = "too_large"
        elif kind == 8:  # binary garbage under a binary content type
            ct = ["application/x-npy", "application/x-npz", "application/x-safetensors"][i % 3]
            payload, code = rng.bytes(int(rng.integers(0, 600))), "malformed"
            if ct.endswith("npy"):
                payload = b"\x93NUMPY\x01\x00" + payload  # magic, then nonsense
        elif kind == 9:  # random bytes, no content type
            ct = None
            payload = b"\x01" + rng.bytes(int(rng.integers(8, 400)))
            code = "malformed"
        elif kind == 10:  # fields of the wrong type or value
            field, code = [("timeout_ms", "invalid_job"), ("stream", "invalid_job"),
                           ("v", "unsupported"), ("accept", "unsupported")][i % 4]  # fmt: skip
            val = {"timeout_ms": "soon", "stream": "maybe", "v": 7, "accept": "xml"}[field]
            body = {"id": jid, field: val, "inputs": {"image": good}}
        elif kind == 11:  # a declared shape far beyond the limit (must not be allocated)
            t = {"dtype": "f32", "shape": [1 << 20, 1 << 20], "b64": "AAAA"}
            body, code = {"id": jid, "inputs": {"image": t}}, "too_large"
        elif kind == 12:  # nesting deeper than the JSON parser allows
            payload, code = (
                (b'{"id":"' + jid.encode() + b'","inputs":' + b"[" * 50_000),
                "malformed",
            )
        elif kind == 13:  # .npy: pickled objects, or a header that lies about its size
            ct = "application/x-npy"
            payload, code = [
                (npy("|O", (1,), b"\x80\x04N."), "unsupported"),
                (npy("<f4", (1, 1, 8, 8), b"\0" * 12), "malformed"),
                (npy("<f4", (1 << 30, 64), b"\0" * 64), "too_large"),
                (npy("<f4", (1, 8, 8), x.tobytes()), "bad_input"),
            ][i % 4]
        elif kind == 14:  # no reply address at all: a log line, no reply
            body, code = {"id": jid, "inputs": {"image": "nope"}}, None
        else:  # MQTT 3.1.1 style: reply_to + correlation in the body, bad inputs
            body = {"id": jid, "reply_to": REPLIES, "correlation": i, "inputs": {"image": [[1]]}}
            code = "bad_input"
        if body is not None:
            payload = json.dumps(body).encode()
        out.append({"i": i, "payload": payload, "ct": ct, "user": user, "code": code,
                    "v5": kind not in (14, 15)})  # fmt: skip
    return out


def codec_dtype(short: str):
    from edgepack.runtime.serve.codec import DTYPES

    return DTYPES[short]


@pytest.fixture(scope="module")
def agent_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("mqtt-fuzz")
    bundle = mb.digits_bundle(tmp_path_factory.getbasetemp(), 1)
    broker = mb.Broker(d / "broker").start()
    watcher = mb.StatusWatcher(broker.url)
    try:
        agent = mb.Agent(bundle, broker.url, "fz", "--no-fleet", "--max-job-bytes", "64K",
                         logdir=d)  # fmt: skip
        watcher.wait("fz", "online", agent=agent)
        yield broker, agent, load(bundle)
    finally:
        watcher.close()
        mb.cleanup()


class Sender:
    """A bare paho client that publishes cases and collects the replies by case."""

    def __init__(self, url: str) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._P, self._PT = Properties, PacketTypes
        self.replies: dict[int, list[dict]] = {}
        self._lock = threading.Lock()
        self.c = mb.mqtt_client(url, f"fuzzer-{time.monotonic_ns()}")
        self.c.on_message = self._on_message
        sub = threading.Event()
        self.c.on_subscribe = lambda *a: sub.set()
        self.c.subscribe(REPLIES, 1)
        assert sub.wait(10)

    def _on_message(self, client, userdata, msg) -> None:
        r = json.loads(msg.payload)
        corr = (
            msg.properties.CorrelationData if hasattr(msg.properties, "CorrelationData") else None
        )
        key = int(corr) if corr else int(r["correlation"])
        with self._lock:
            self.replies.setdefault(key, []).append(r)

    def send(self, case: dict) -> None:
        props = self._P(self._PT.PUBLISH)
        if case["v5"]:
            props.ResponseTopic = REPLIES
            props.CorrelationData = str(case["i"]).encode()
        if case["ct"]:
            props.ContentType = case["ct"]
        if case["user"]:
            props.UserProperty = list(case["user"].items())
        self.c.publish(JOBS, case["payload"], 1, properties=props)

    def wait(self, keys: set[int], timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if keys <= set(self.replies):
                    return
            time.sleep(0.05)
        missing = sorted(keys - set(self.replies))
        raise AssertionError(f"{len(missing)} cases got no reply, e.g. {missing[:10]}")


def test_1000_malformed_jobs_each_get_an_error_and_the_agent_keeps_serving(agent_env):
    broker, agent, ref = agent_env
    x = mb.digits_inputs()[:1]
    s = Sender(broker.url)
    warm = fuzz_cases(200, seed=1, x=x)  # warm-up round: allocator, caches, log buffers
    for c in warm:
        s.send(c)
    s.wait({c["i"] for c in warm if c["code"]})
    rss_before = agent.rss_kb()
    s.replies.clear()
    log_before = agent.log().count("no reply address")

    cases = fuzz_cases(1000, seed=2, x=x)
    for c in cases:
        s.send(c)
    expect = {c["i"]: c["code"] for c in cases if c["code"]}
    s.wait(set(expect))
    time.sleep(0.5)  # a second reply to any case would show up now
    wrong = {
        i: (expect[i], [r.get("error", {}).get("code") for r in s.replies[i]])
        for i in expect
        if [r.get("error", {}).get("code") for r in s.replies[i]] != [expect[i]]
    }
    assert not wrong, f"{len(wrong)} cases got other replies: {list(wrong.items())[:8]}"
    assert all(
        r["status"] == "error" and r["error"]["message"] for v in s.replies.values() for r in v
    )
    no_reply = sum(c["code"] is None for c in cases)
    assert agent.log().count("no reply address") - log_before == no_reply
    rss_after = agent.rss_kb()
    print(f"\n{len(cases)} malformed jobs: {len(expect)} error replies, {no_reply} log lines; "
          f"RSS {rss_before} -> {rss_after} kB")  # fmt: skip
    assert rss_after - rss_before < 8 * 1024, "agent memory grew by more than 8 MB"

    # still serving, and still right
    body = {"id": "after-fuzz", "inputs": {"image": x.tolist()}, "reply_to": REPLIES,
            "correlation": 99999}  # fmt: skip
    s.c.publish(JOBS, json.dumps(body), 1)
    s.wait({99999})
    r = s.replies[99999][0]
    assert r["status"] == "ok"
    y = np.asarray(r["outputs"]["logits"]["data"], np.float32).reshape(1, 10)
    assert np.array_equal(y, ref.run({"image": x})["logits"])
    assert agent.proc.poll() is None
    s.c.disconnect()
    s.c.loop_stop()
