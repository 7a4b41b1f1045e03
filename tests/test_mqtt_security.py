"""TLS with client certificates, passwords and ACLs, as docs/protocol.md recommends:
a device reads only its own job topics (and its model's fleet topic) and writes only
its status, metrics and replies. Shown here: jobs over mqtts work end to end; a
refused connection (bad password, no client certificate); a refused cross-device
publish (PUBACK 135); a forbidden subscription that the broker "grants" but never
feeds; and that no password ends up in a log or a status message."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import mqtt_broker as mb
import numpy as np
import pytest
from conftest import cli_env, load
from edgepack.runtime.serve.conn import ConnectError

from edgepack.client import Client

pytestmark = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        not mb.have_mosquitto(), reason="needs mosquitto (apt-get install mosquitto)"
    ),
]

PASSWORDS = {"devA": "pw-A-s3cret", "devB": "pw-B-s3cret", "alice": "alice-s3cret"}

# The ACL of docs/protocol.md ("Securing a fleet"): submitters by name, devices by
# pattern (%u = the username, which is the device id).
ACL = """\
user alice
topic write edgepack/v1/dev/+/jobs
topic write edgepack/v1/model/+/jobs
topic write edgepack/v1/blob/alice/#
topic read edgepack/v1/reply/alice/#
topic read edgepack/v1/dev/+/status

pattern read edgepack/v1/dev/%u/jobs
pattern read edgepack/v1/model/+/jobs
pattern read edgepack/v1/blob/#
pattern write edgepack/v1/dev/%u/status
pattern write edgepack/v1/dev/%u/metrics
pattern write edgepack/v1/reply/#
"""


@pytest.fixture(scope="module")
def sec(tmp_path_factory):
    d = tmp_path_factory.mktemp("mqtt-sec")
    tls = mb.make_tls(d / "tls", clients=tuple(PASSWORDS))
    pw = d / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        flags = ["-b", "-c"] if i == 0 else ["-b"]
        subprocess.run(["mosquitto_passwd", *flags, str(pw), user, password], check=True,
                       capture_output=True, timeout=30)  # fmt: skip
    (d / "acl").write_text(ACL)
    broker = mb.Broker(d / "broker", tls=tls, password_file=pw, acl_file=d / "acl").start()
    bundle = mb.digits_bundle(tmp_path_factory.getbasetemp(), 1)
    (d / "devB.pw").write_text(PASSWORDS["devB"] + "\n")
    auth = dict(username="alice", password=PASSWORDS["alice"], ca=tls["ca"],
                cert=tls["alice_cert"], key=tls["alice_key"])  # fmt: skip
    watcher = mb.StatusWatcher(broker.url, **auth)
    try:

        def agent(dev: str, *extra: str, env=None):
            return mb.Agent(bundle, broker.url, dev, "--model", "digits", "--ca", tls["ca"],
                            "--cert", tls[f"{dev}_cert"], "--key", tls[f"{dev}_key"],
                            "--username", dev, *extra, logdir=d, env=env)  # fmt: skip

        agents = {
            # password from the environment, and from a file
            "devA": agent("devA", env={"EDGEPACK_MQTT_PASSWORD": PASSWORDS["devA"]}),
            "devB": agent("devB", "--password-file", str(d / "devB.pw")),
        }
        for name, a in agents.items():
            watcher.wait(name, "online", agent=a)
        yield SimpleNamespace(broker=broker, tls=tls, agents=agents, watcher=watcher,
                              bundle=bundle, dir=d, ref=load(bundle))  # fmt: skip
    finally:
        watcher.close()
        mb.cleanup()


def alice(sec, **kw) -> Client:
    t = sec.tls
    args = dict(username="alice", password=PASSWORDS["alice"], ca=t["ca"],
                cert=t["alice_cert"], key=t["alice_key"])  # fmt: skip
    return Client(sec.broker.url, **(args | kw))


def test_jobs_over_tls_with_passwords(sec):
    x = mb.digits_inputs()[:4]
    want = np.concatenate([sec.ref.run({"image": x[i : i + 1]})["logits"] for i in range(4)])
    with alice(sec) as c:
        for dev in ("devA", "devB"):
            job = c.submit(x, device=dev)
            assert np.array_equal(job.result(timeout=30)["logits"], want)
            assert job.device == dev
        assert np.array_equal(c.infer({"image": x}, model="digits")["logits"], want)


def test_refused_connections(sec):
    t = sec.tls
    with pytest.raises(ConnectError, match="refused the connection: Not authorized"):
        alice(sec, password="wrong")
    with pytest.raises(ConnectError, match="certificate required"):  # TLS, no client cert
        alice(sec, cert=None, key=None, connect_timeout=5)
    # The agent command exits 1 with one clear line, and never prints the password.
    r = subprocess.run(
        [sys.executable, "-m", "edgepack.cli", "serve", str(sec.bundle), "--broker", sec.broker.url,
         "--device", "devA", "--username", "devA", "--ca", t["ca"], "--cert", t["devA_cert"],
         "--key", t["devA_key"]],
        env=cli_env({"EDGEPACK_MQTT_PASSWORD": "not-the-password"}),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    assert "edgepack: error: broker mqtts://127.0.0.1" in r.stderr
    assert "refused the connection: Not authorized" in r.stderr
    assert "not-the-password" not in r.stdout + r.stderr


def test_device_cannot_publish_to_another_device(sec):
    t = sec.tls
    evil = mb.mqtt_client(sec.broker.url, "devA-evil", username="devA",
                          password=PASSWORDS["devA"], ca=t["ca"], cert=t["devA_cert"],
                          key=t["devA_key"])  # fmt: skip
    acks: dict[int, int] = {}
    done = threading.Event()

    def on_publish(client, userdata, mid, rc, props):
        acks[mid] = rc.value
        done.set()

    evil.on_publish = on_publish
    info = evil.publish("edgepack/v1/dev/devB/jobs", b'{"id":"evil","inputs":{}}', 1)
    assert done.wait(10)
    assert acks[info.mid] == 135  # PUBACK "Not authorized": the broker dropped it
    with alice(sec) as c:  # ...and devB never saw it, while alice's jobs still go through
        assert c.infer(mb.digits_inputs()[:1], device="devB")["logits"].shape == (1, 10)
    assert "evil" not in sec.agents["devB"].log()
    evil.disconnect()
    evil.loop_stop()


def test_device_reads_only_its_own_jobs(sec):
    """Mosquitto grants a SUBSCRIBE to a forbidden topic (SUBACK QoS 1) and then simply
    delivers nothing: the ACL acts on delivery."""
    t = sec.tls
    spy = mb.mqtt_client(sec.broker.url, "devA-spy", username="devA",
                         password=PASSWORDS["devA"], ca=t["ca"], cert=t["devA_cert"],
                         key=t["devA_key"])  # fmt: skip
    granted, seen = [], []
    subbed = threading.Event()
    spy.on_subscribe = lambda c, ud, mid, rcs, p: (
        granted.extend(r.value for r in rcs),
        subbed.set(),
    )
    spy.on_message = lambda c, ud, m: seen.append(m.topic)
    spy.subscribe("edgepack/v1/dev/devB/jobs", 1)
    assert subbed.wait(10) and granted == [1]
    with alice(sec) as c:
        job = c.submit(mb.digits_inputs()[:1], device="devB")
        job.result(timeout=30)
        assert job.device == "devB"
    time.sleep(0.5)
    assert seen == []
    spy.disconnect()
    spy.loop_stop()


def test_no_secret_in_logs_or_status(sec):
    for name, a in sec.agents.items():
        log = a.log()
        assert "serving:" in log
        assert all(p not in log for p in PASSWORDS.values())
        status = sec.watcher.status[name]
        assert all(p not in str(status) for p in PASSWORDS.values())


def test_job_for_a_device_nobody_serves_says_so(sec):
    """The broker answers a publish that no subscription matches with PUBACK reason 16
    ("no matching subscribers"): the client retries (agents may be reconnecting), then
    gives up naming the topic."""
    from edgepack.client import JobTimeout

    with alice(sec) as c:
        assert c.reply_topic.startswith("edgepack/v1/reply/alice/")
        with pytest.raises(JobTimeout, match="no agent is subscribed to .*/dev/ghost/jobs"):
            c.infer(mb.digits_inputs()[:1], device="ghost", timeout=2, retries=1)


def test_refused_job_publish_is_a_job_error(sec):
    """alice may not write outside the job topics: the broker answers PUBACK 135 and
    the client fails the job at once instead of waiting for a timeout."""
    from edgepack.client import JobError

    with alice(sec, prefix="elsewhere/v1") as c:
        with pytest.raises(JobError) as e:
            c.infer(mb.digits_inputs()[:1], device="devA", timeout=30)
    assert e.value.code == "not_authorized" and "Not authorized" in e.value.message
