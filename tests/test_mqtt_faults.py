"""Faults with a real Mosquitto and three agents on one shared subscription: they share
the jobs; one is SIGKILLed mid-stream; the broker is SIGKILLed and restarted
mid-stream. Every time, every job is answered exactly once to the caller.

Each test prints its counts (sent, resent, answered, duplicates dropped by the client,
lost); ``pytest -s`` shows them.
"""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import mqtt_broker as mb
import numpy as np
import pytest
from conftest import load

from edgepack.client import Client

pytestmark = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        not mb.have_mosquitto(), reason="needs mosquitto (apt-get install mosquitto)"
    ),
]

N_JOBS = 300
DEVICES = ("f1", "f2", "f3")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("mqtt-faults")
    bundle = mb.digits_bundle(tmp_path_factory.getbasetemp(), 1)
    broker = mb.Broker(d / "broker").start()
    watcher = mb.StatusWatcher(broker.url)
    try:
        agents = {
            name: mb.Agent(bundle, broker.url, name, "--model", "digits", logdir=d)
            for name in DEVICES
        }
        for name, a in agents.items():
            watcher.wait(name, "online", agent=a)
        X = np.concatenate([mb.digits_inputs()] * 2)[:N_JOBS]
        ref = load(bundle)
        want = np.stack([ref.run({"image": X[i : i + 1]})["logits"][0] for i in range(N_JOBS)])
        yield SimpleNamespace(broker=broker, watcher=watcher, agents=agents, X=X, want=want, dir=d)
    finally:
        watcher.close()
        mb.cleanup()


def run_stream(fleet, client: Client, fault=None, at: int = 100, window: int = 30) -> dict:
    """Send N_JOBS fleet jobs with at most ``window`` unanswered, call ``fault()`` once
    ``at`` jobs are answered, and check every answer. Returns the counts."""
    X, want = fleet.X, fleet.want
    jobs, answered, by_device = {}, 0, Counter()
    nxt, faulted = 0, fault is None
    end = time.monotonic() + 120
    while answered < N_JOBS:
        assert time.monotonic() < end, f"only {answered} of {N_JOBS} answered"
        while nxt < N_JOBS and nxt - answered < window:
            jobs[nxt] = client.submit({"image": X[nxt : nxt + 1]}, model="digits",
                                      timeout=60, retry_after=1.0, retries=30)  # fmt: skip
            nxt += 1
        for i in [i for i, j in jobs.items() if j.done()]:
            j = jobs.pop(i)
            y = j.result()["logits"]  # raises if the job failed
            assert np.array_equal(y[0], want[i]), f"job {i} from {j.device}"
            by_device[j.device] += 1
            answered += 1
        if not faulted and answered >= at:
            fault()
            faulted = True
        time.sleep(0.002)
    s = client.stats
    counts = {
        "sent": s["sent"],
        "resent": s["resent"],
        "answered": s["answered"],
        "failed": s["failed"],
        "duplicates_dropped": s["duplicates"],
        "lost": N_JOBS - s["answered"],
        "by_device": dict(by_device),
    }
    print(f"\n{counts}")
    assert counts["answered"] == N_JOBS and counts["failed"] == 0 and counts["lost"] == 0
    return counts


def test_three_agents_share_300_jobs(fleet):
    with Client(fleet.broker.url) as c:
        counts = run_stream(fleet, c, window=N_JOBS)
    assert set(counts["by_device"]) == set(DEVICES)  # the shared subscription spread them
    assert sum(counts["by_device"].values()) == N_JOBS


def test_agent_sigkilled_mid_stream(fleet):
    victim = fleet.agents["f2"]
    with Client(fleet.broker.url) as c:
        counts = run_stream(fleet, c, fault=victim.kill)
    # its last will told everyone
    assert fleet.watcher.wait("f2", "offline", timeout=10)["reason"] == "connection lost"
    assert counts["by_device"].get("f1") and counts["by_device"].get("f3")


def test_broker_killed_and_restarted_mid_stream(fleet):
    def restart():
        fleet.broker.kill()
        time.sleep(1.0)
        fleet.broker.start()

    live = [n for n in DEVICES if fleet.agents[n].proc.poll() is None]
    with Client(fleet.broker.url) as c:
        run_stream(fleet, c, fault=restart)  # asserts every job answered exactly once
    for n in live:  # back online: the restarted broker had forgotten their status
        fleet.watcher.wait(n, "online", timeout=30)
        assert "reconnected" in fleet.agents[n].log()
