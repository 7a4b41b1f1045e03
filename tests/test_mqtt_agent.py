"""The MQTT agent against a real Mosquitto: answers equal the local runtime bit for bit,
dynamic batching, streams, de-duplication, deadlines, busy replies, MQTT 3.1.1 clients,
the ``submit`` command, ``mosquitto_pub``/``mosquitto_sub``, inputs sent by reference,
and a SIGTERM that drops no accepted job."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import mqtt_broker as mb
import numpy as np
import pytest
from conftest import cli_env, load

from edgepack.client import Client, JobError

pytestmark = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        not mb.have_mosquitto(), reason="needs mosquitto (apt-get install mosquitto)"
    ),
]

PACKET_LIMIT = 64 * 1024  # the broker's max_packet_size: larger inputs go by reference


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    d = tmp_path_factory.mktemp("mqtt-agent")
    b1, b4 = mb.digits_bundle(base, 1), mb.digits_bundle(base, 4)
    broker = mb.Broker(d / "broker", max_packet_size=PACKET_LIMIT).start()
    watcher = mb.StatusWatcher(broker.url)
    try:
        agents = {
            "dev-a": mb.Agent(b1, broker.url, "dev-a", "--model", "digits", logdir=d),
            # batched bundle, two arenas; a long batching window so that jobs sent
            # together are combined
            "dev-b4": mb.Agent(
                b4,
                broker.url,
                "dev-b4",
                "--model",
                "digits4",
                "--workers",
                "2",
                "--max-wait-ms",
                "250",
                logdir=d,
            ),  # fmt: skip
            # a queue of 2 jobs and a slow batching window: the third job finds it full
            "dev-q": mb.Agent(
                b4,
                broker.url,
                "dev-q",
                "--no-fleet",
                "--queue",
                "2",
                "--max-wait-ms",
                "400",
                logdir=d,
            ),  # fmt: skip
        }
        for name, a in agents.items():
            watcher.wait(name, "online", agent=a)
        client = Client(broker.url)
        yield SimpleNamespace(
            broker=broker, watcher=watcher, agents=agents, client=client, dir=d,
            b1=b1, b4=b4, ref1=load(b1), ref4=load(b4), X=mb.digits_inputs(),
        )  # fmt: skip
        client.close()
    finally:
        watcher.close()
        mb.cleanup()


@pytest.mark.parametrize("encoding", ["safetensors", "npz", "json", "b64"])
def test_answers_equal_local_run(env, encoding):
    c, X = env.client, env.X
    want = mb.digits_ref_rows(env.ref1, X[:12])
    jobs = [
        c.submit(
            {"image": X[i : i + 1]},
            **({"device": "dev-a"} if i % 2 else {"model": "digits"}),
            encoding=encoding,
        )  # fmt: skip
        for i in range(12)
    ]
    for i, j in enumerate(jobs):
        y = j.result(timeout=30)["logits"]
        assert y.dtype == np.float32 and y.shape == (1, 10)
        assert np.array_equal(y[0], want[i]), f"job {i} ({encoding})"
        assert j.device == "dev-a"
    # one job of 7 rows on a batch-1 bundle: 7 runs, one answer
    y = c.infer(X[20:27], device="dev-a", encoding=encoding if encoding != "b64" else "npy")
    assert np.array_equal(y["logits"], mb.digits_ref_rows(env.ref1, X[20:27]))


def test_batched_bundle_combines_jobs_and_matches_run(env):
    c, X = env.client, env.X
    sizes = [1, 1, 2, 1, 3, 1, 5, 1, 9, 1]  # 25 rows, some jobs larger than a batch
    jobs, start = [], 0
    for n in sizes:
        jobs.append((start, n, c.submit({"image": X[start : start + n]}, model="digits4")))
        start += n
    combined = 0
    for s, n, j in jobs:
        y = j.result(timeout=30)["logits"]
        assert np.array_equal(y, mb.digits_ref_rows(env.ref4, X[s : s + n]))
        combined += j.meta["timing"]["batch_rows"] > n  # ran together with another job
    assert combined > 0


def test_stream_yields_each_row_once(env):
    c, X = env.client, env.X
    job = c.submit({"image": X[:10]}, device="dev-b4", stream=True)
    seen = np.zeros(10, int)
    for part in job.parts(timeout=30):
        a, b = part.rows
        seen[a:b] += 1
        assert part.device == "dev-b4"
        assert np.array_equal(part.outputs["logits"], mb.digits_ref_rows(env.ref4, X[a:b]))
    assert (seen == 1).all()
    assert np.array_equal(job.result()["logits"], mb.digits_ref_rows(env.ref4, X[:10]))


def test_resent_job_id_gets_the_stored_answer(env):
    c, X = env.client, env.X
    first = c.submit({"image": X[:1]}, device="dev-a", job_id="same-id-1")
    y1 = first.result(timeout=30)["logits"]
    assert not first.meta.get("dup")
    again = c.submit({"image": X[5:6]}, device="dev-a", job_id="same-id-1")  # other inputs!
    y2 = again.result(timeout=30)["logits"]
    assert again.meta.get("dup") is True  # answered from memory, not run again
    assert np.array_equal(y1, y2)


def raw_job(env, topic: str, body: dict, *, v5: bool = True, timeout: float = 10.0) -> dict:
    """Publish one JSON job with a bare paho client and return the JSON reply."""
    got: list = []
    ev = threading.Event()
    cid = f"raw-{time.monotonic_ns()}"
    cl = mb.mqtt_client(env.broker.url, cid, protocol="v5" if v5 else "v311")
    reply = f"edgepack/v1/reply/{cid}"

    def on_message(client, userdata, msg):
        got.append(json.loads(msg.payload))
        ev.set()

    cl.on_message = on_message
    sub = threading.Event()
    cl.on_subscribe = lambda *a: sub.set()
    cl.subscribe(reply, 1)
    assert sub.wait(10)
    if v5:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = reply, b"corr-1"
        cl.publish(topic, json.dumps(body), 1, properties=props)
    else:
        cl.publish(topic, json.dumps(body | {"reply_to": reply, "correlation": "c-311"}), 1)
    try:
        assert ev.wait(timeout), "no reply"
        return got[0]
    finally:
        cl.disconnect()
        cl.loop_stop()


def test_mqtt_3_1_1_client_gets_json_answer(env):
    x = env.X[3:4]
    body = {"id": "v311-1", "inputs": {"image": x.tolist()}}
    r = raw_job(env, "edgepack/v1/dev/dev-a/jobs", body, v5=False)
    assert r["status"] == "ok" and r["correlation"] == "c-311" and r["device"] == "dev-a"
    y = np.asarray(r["outputs"]["logits"]["data"], np.float32).reshape(
        r["outputs"]["logits"]["shape"]
    )
    assert np.array_equal(y, mb.digits_ref_rows(env.ref1, x))


def test_past_deadline_gets_error_not_answer(env):
    body = {"id": "late-1", "deadline_ms": int(time.time() * 1e3) - 5000,
            "inputs": {"image": env.X[:1].tolist()}}  # fmt: skip
    r = raw_job(env, "edgepack/v1/dev/dev-a/jobs", body)
    assert r["status"] == "error" and r["error"]["code"] == "deadline_exceeded"
    assert "outputs" not in r


def test_full_queue_answers_busy_and_client_retries(env):
    X = env.X
    # dev-q holds 2 jobs; its batcher waits 400 ms for a full batch, so jobs 3..8 of
    # this burst find the queue full and get "busy" (and the client retries them).
    jobs = [
        env.client.submit({"image": X[i : i + 1]}, device="dev-q", timeout=30) for i in range(8)
    ]
    for i, j in enumerate(jobs):
        want = mb.digits_ref_rows(env.ref4, X[i : i + 1])
        assert np.array_equal(j.result(timeout=60)["logits"], want)
    assert env.client.stats["retryable_errors"] > 0
    r = raw_job(
        env, "edgepack/v1/dev/dev-q/jobs", {"id": "q-0", "inputs": {"image": X[:1].tolist()}}
    )
    assert r["status"] == "ok"


def test_bad_input_error_reply(env):
    with pytest.raises(JobError) as e:
        env.client.infer({"image": env.X[0]}, device="dev-a")  # [1, 8, 8]: no batch dimension
    assert e.value.code == "bad_input" and "expected: image f32[Nx1x8x8]" in e.value.message


def test_large_input_goes_by_reference(env):
    X = np.concatenate([env.X] * 2)[:400]  # 400 rows: 102 KB, over the broker's 64 KB
    before = env.client.stats["by_reference"]
    y = env.client.infer({"image": X}, model="digits4", timeout=60)
    assert env.client.stats["by_reference"] == before + 1
    assert np.array_equal(y["logits"], mb.digits_ref_rows(env.ref4, X))


def ep(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepack.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=cli_env(),
                          **kw)  # fmt: skip


def test_submit_command_equals_run_command(env, tmp_path):
    np.save(tmp_path / "x.npy", env.X[7:8])
    r = ep("run", env.b1, "--input", tmp_path / "x.npy", "--output", tmp_path / "run.npz")
    assert r.returncode == 0, r.stderr
    r = ep("submit", "--broker", env.broker.url, "--device", "dev-a", "--input", tmp_path / "x.npy",
           "--output", tmp_path / "mqtt.npz")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "answered by dev-a" in r.stdout
    with np.load(tmp_path / "run.npz") as a, np.load(tmp_path / "mqtt.npz") as b:
        assert a.files == b.files == ["logits"]
        assert np.array_equal(a["logits"], b["logits"])
    np.savez(tmp_path / "x6.npz", image=env.X[:6])
    url = env.broker.url
    r = ep("submit", "--broker", url, "--model", "digits4", "--input", tmp_path / "x6.npz",
           "--stream")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "rows 0-4 from dev-b4" in r.stdout and "prediction: class" in r.stdout
    r = ep("submit", "--broker", url, "--device", "dev-a", "--input", tmp_path / "x6.npz",
           "--encoding", "json")  # fmt: skip
    assert r.returncode == 0 and "[5] prediction" in r.stdout


def test_mosquitto_pub_and_sub_walkthrough(env, tmp_path):
    """The README walk-through, with the Mosquitto command-line clients."""
    port = str(env.broker.port)
    sub_args = ["mosquitto_sub", "-h", "127.0.0.1", "-p", port, "-V", "mqttv5", "-C", "1",
                "-W", "30", "-t", "edgepack/v1/reply/walk"]  # fmt: skip
    x = env.X[9:10]
    want = mb.digits_ref_rows(env.ref1, x)
    # JSON in, JSON out
    sub = subprocess.Popen(sub_args, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # let mosquitto_sub subscribe
    body = json.dumps({"id": "walk-1", "inputs": {"image": x.tolist()}})
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-V", "mqttv5", "-q", "1",
                    "-t", "edgepack/v1/dev/dev-a/jobs", "-D", "publish", "response-topic",
                    "edgepack/v1/reply/walk", "-m", body], check=True, timeout=30)  # fmt: skip
    out, _ = sub.communicate(timeout=60)
    r = json.loads(out)
    assert r["status"] == "ok"
    t = r["outputs"]["logits"]
    assert np.array_equal(np.asarray(t["data"], np.float32).reshape(t["shape"]), want)
    # .npy in, .npy out
    np.save(tmp_path / "x.npy", x)
    sub = subprocess.Popen(sub_args + ["-N"], stdout=subprocess.PIPE)
    time.sleep(0.5)
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-V", "mqttv5", "-q", "1",
                    "-t", "edgepack/v1/dev/dev-a/jobs", "-D", "publish", "response-topic",
                    "edgepack/v1/reply/walk", "-D", "publish", "content-type", "application/x-npy",
                    "-D", "publish", "user-property", "ep-id", "walk-2",
                    "-f", str(tmp_path / "x.npy")], check=True, timeout=30)  # fmt: skip
    out, _ = sub.communicate(timeout=60)
    assert np.array_equal(np.load(io.BytesIO(out)), want)


def _doc_client() -> str:
    """The "Writing a client" example of docs/protocol.md, as printed."""
    from conftest import REPO

    doc = (REPO / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## Writing a client") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_client_works_as_written(env, tmp_path):
    code = _doc_client()
    port = env.broker.url.rsplit(":", 1)[1]
    assert 'c.connect("127.0.0.1", 1883)' in code
    code = code.replace('c.connect("127.0.0.1", 1883)', f'c.connect("127.0.0.1", {port})')
    script = tmp_path / "client.py"
    # the shipped model under its default name (no --model), taking the example's
    # fleet jobs
    a = mb.Agent(env.b1, env.broker.url, "dev-doc", logdir=env.dir)
    env.watcher.wait("dev-doc", "online", agent=a)
    try:
        script.write_text(code + "\nprint(logits.shape)\n")
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 0 and "(1, 10)" in r.stdout, r.stderr[-2000:]
        # nobody serves this topic: the example reports a timeout, not a KeyError
        script.write_text(code.replace("model/digits_cnn/jobs", "model/nobody/jobs"))
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode != 0 and "TimeoutError: no answer to job" in r.stderr, r.stderr
    finally:
        assert a.terminate() == 0


def test_sigterm_answers_every_accepted_job(env):
    """SIGTERM while jobs are queued: each job gets exactly one answer (ok, or
    shutting_down for those that arrived during the drain); jobs the agent never took
    stay in its persistent session and are answered when it comes back."""
    d = env.dir
    a = mb.Agent(env.b4, env.broker.url, "dev-t", "--no-fleet", "--max-wait-ms", "100", logdir=d)
    env.watcher.wait("dev-t", "online", agent=a)
    replies: dict[str, list] = {}
    lock = threading.Lock()
    cl = mb.mqtt_client(env.broker.url, "term-sender")

    def on_message(client, userdata, msg):
        r = json.loads(msg.payload)
        with lock:
            replies.setdefault(r["id"], []).append(
                r["status"] if r["status"] == "ok" else r["error"]["code"]
            )

    cl.on_message = on_message
    cl.subscribe("edgepack/v1/reply/term", 1)
    time.sleep(0.3)
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = "edgepack/v1/reply/term"
    infos = [
        cl.publish(
            "edgepack/v1/dev/dev-t/jobs",
            json.dumps({"id": f"t{i}", "inputs": {"image": env.X[i : i + 1].tolist()}}),
            1,
            properties=props,
        )  # fmt: skip
        for i in range(60)
    ]
    for info in infos:
        info.wait_for_publish(10)
    assert a.terminate(timeout=60) == 0
    assert env.watcher.wait("dev-t", "offline")["reason"] == "shutdown"
    assert "stopped:" in a.log()
    # back again: the jobs that were still in the broker for dev-t come in now
    a2 = mb.Agent(env.b4, env.broker.url, "dev-t", "--no-fleet", logdir=d)
    env.watcher.wait("dev-t", "online", agent=a2)
    end = time.monotonic() + 60
    while len(replies) < 60 and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(0.5)  # any duplicate would arrive now
    cl.disconnect()
    cl.loop_stop()
    with lock:
        assert sorted(replies) == sorted(f"t{i}" for i in range(60))
        assert all(len(v) == 1 and v[0] in ("ok", "shutting_down") for v in replies.values())
        assert sum(v == ["ok"] for v in replies.values()) > 0
    a2.terminate()
