"""The MQTT protocol pieces without a broker: tensor codecs (also on hostile bytes), job
envelopes, replies, the scheduler's batching and deadlines, and the answer store."""

from __future__ import annotations

import io
import json
import struct
import threading
import time
import zipfile

import numpy as np
import pytest
from conftest import DATA, pack
from edgepack.runtime.serve import codec
from edgepack.runtime.serve.protocol import (
    Props,
    ProtocolError,
    Reply,
    ReplyAddress,
    error_meta,
    ok_reply,
    parse_job,
    parse_reply,
    render,
)
from edgepack.runtime.serve.sched import Job, Scheduler
from edgepack.runtime.serve.store import ReplyStore

F32 = {"image": np.dtype("<f4")}
LIMIT = 1 << 20


def parse(payload, limit=LIMIT, **props):
    return parse_job(payload, Props(**props), limit=limit, input_dtypes=F32, prefix="edgepack/v1")


def arrays():
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.integers(-128, 127, (4,), dtype=np.int8),
        "c": rng.standard_normal((1, 2, 2)).astype(np.float16),
    }


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_binary_codecs_round_trip_bit_exact(fmt):
    src = arrays()
    data, ctype = codec.encode_binary(src, fmt)
    out = codec.decode_binary(data, ctype, LIMIT, None)
    assert out.keys() == src.keys()
    for k in src:
        assert out[k].dtype == src[k].dtype and np.array_equal(out[k], src[k])


def test_npy_and_json_round_trip_bit_exact():
    x = np.random.default_rng(1).standard_normal((3, 1, 8, 8)).astype(np.float32)
    assert np.array_equal(codec.decode_npy(codec.encode_npy(x), LIMIT), x)
    # Fortran order and big-endian .npy are read as the same values
    f = io.BytesIO()
    np.save(f, np.asfortranarray(x).astype(">f4"))
    assert np.array_equal(codec.decode_npy(f.getvalue(), LIMIT), x)
    for b64 in (False, True):
        t = json.loads(json.dumps(codec.tensor_to_json(x, b64)))
        got = codec.tensors_from_json({"x": t}, LIMIT)["x"]
        assert got.dtype == np.float32 and np.array_equal(got, x)
    # non-finite values have no JSON spelling: sent as base64, still exact
    y = np.array([np.nan, np.inf, -1.5], np.float32)
    t = codec.tensor_to_json(y)
    assert "b64" in t
    np.testing.assert_array_equal(codec.tensors_from_json({"y": t}, LIMIT)["y"], y)


def npy_header(descr: str, shape: tuple, body: bytes = b"") -> bytes:
    h = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    h += b" " * (-(len(h) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + body


def zip_bomb() -> bytes:
    f = io.BytesIO()
    # a fixed entry time: the bytes name the test, and xdist workers that collect
    # them a second apart must agree on its id
    entry = zipfile.ZipInfo("image.npy", date_time=(2020, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(
            entry, npy_header("<f4", (4 << 20,)) + bytes(16 << 20), zipfile.ZIP_DEFLATED
        )  # 16 MB
    return f.getvalue()


@pytest.mark.parametrize(
    "payload, ctype, code",
    [
        (npy_header("<f4", (1 << 40,), b"\0" * 16), codec.CT_NPY, "too_large"),
        (npy_header("<f4", (1, 1, 8, 8), b"\0" * 16), codec.CT_NPY, "malformed"),
        (npy_header("|O", (1,), b"\0" * 8), codec.CT_NPY, "unsupported"),
        (npy_header("<c8", (1,), b"\0" * 8), codec.CT_NPY, "unsupported"),
        (b"\x93NUMPY\x01\x00\xff\xff{", codec.CT_NPY, "malformed"),
        (b"PK\x03\x04garbage", codec.CT_NPZ, "malformed"),
        (zip_bomb(), codec.CT_NPZ, "too_large"),
        (struct.pack("<Q", 1 << 60) + b"{}", codec.CT_SAFETENSORS, "malformed"),
        (
            struct.pack("<Q", 60) + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,99999]}}',
            codec.CT_SAFETENSORS,
            "malformed",
        ),
        (b"\x00" * 3, codec.CT_SAFETENSORS, "malformed"),
        (b"anything", "image/png", "unsupported"),
    ],
)
def test_hostile_binary_payloads_are_codec_errors(payload, ctype, code):
    with pytest.raises(codec.CodecError) as e:
        codec.decode_binary(payload, ctype, LIMIT, "image")
    assert e.value.code == code


def test_parse_job_v5_binary_and_json():
    x = np.ones((1, 1, 8, 8), np.float32)
    data, ctype = codec.encode_binary({"image": x}, "safetensors")
    req = parse(
        data,
        content_type=ctype,
        response_topic="r/1",
        correlation=b"c1",
        user={"ep-id": "j1", "ep-timeout-ms": "500", "ep-stream": "1"},
    )
    assert req.id == "j1" and req.stream and req.accept == "safetensors"
    assert req.reply == ReplyAddress("r/1", b"c1", None, True)
    assert 0.4 < req.deadline - req.received <= 0.5
    body = {"id": "j2", "inputs": {"image": x.tolist()}, "reply_to": "r/2", "correlation": 7}
    req = parse(json.dumps(body).encode())  # MQTT 3.1.1: no properties at all
    assert req.reply == ReplyAddress("r/2", None, 7, False) and req.accept == "json"
    assert req.feeds["image"].dtype == np.float32


@pytest.mark.parametrize(
    "body, code",
    [
        (b"{not json", "malformed"),
        (b"[" * 100_000, "malformed"),  # deeper than the JSON parser's recursion limit
        (b'"a string"', "malformed"),
        (json.dumps({"inputs": {}}).encode(), "invalid_job"),  # no id
        (json.dumps({"id": "x" * 200, "inputs": {}}).encode(), "invalid_job"),
        (json.dumps({"id": "j", "v": 2, "inputs": {}}).encode(), "unsupported"),
        (json.dumps({"id": "j"}).encode(), "invalid_job"),
        (json.dumps({"id": "j", "inputs": {"image": "abc"}}).encode(), "malformed"),
        (json.dumps({"id": "j", "inputs": {"image": [[1], [1, 2]]}}).encode(), "malformed"),
        (
            json.dumps({"id": "j", "timeout_ms": -1, "inputs": {"image": [1]}}).encode(),
            "invalid_job",
        ),
        (
            json.dumps(
                {"id": "j", "inputs": {"image": {"dtype": "f32", "shape": [1 << 40], "b64": ""}}}
            ).encode(),
            "too_large",
        ),
        (
            json.dumps(
                {"id": "j", "inputs": {"image": {"dtype": "c64", "shape": [1], "data": [1]}}}
            ).encode(),
            "unsupported",
        ),
        (json.dumps({"id": "j", "ref": {"topic": "elsewhere/x"}}).encode(), "invalid_job"),
        (b"\xff\xfe garbage", "malformed"),
        (json.dumps({"id": "j", "inputs": {}}).encode(), "invalid_job"),  # never bad_input
        # what JSON cannot spell, and numbers past a double, are not read as infinities
        (b'{"id": "j", "inputs": {"image": [NaN]}}', "malformed"),
        (b'{"id": "j", "inputs": {"image": [-Infinity]}}', "malformed"),
        (b'{"id": "j", "inputs": {"image": [1e400]}}', "malformed"),
        # values the dtype cannot hold are named, not wrapped or rounded
        (json.dumps({"id": "j", "inputs": {"image": {"dtype": "i8", "shape": [1],
                                                     "data": [300]}}}).encode(), "bad_input"),
        (json.dumps({"id": "j", "inputs": {"image": {"dtype": "f32", "shape": [1],
                                                     "data": [1e39]}}}).encode(), "bad_input"),
        (json.dumps({"id": "j", "inputs": {"image": {"dtype": "i64", "shape": [1],
                                                     "data": [1.5]}}}).encode(), "bad_input"),
    ],
)  # fmt: skip
def test_bad_jobs_raise_protocol_errors_with_reply_address(body, code):
    with pytest.raises(ProtocolError) as e:
        parse(body, response_topic="r/x", correlation=b"k")
    assert e.value.code == code
    assert e.value.reply is not None and e.value.reply.topic == "r/x"


def test_oversize_payload_is_too_large_with_id_from_properties():
    with pytest.raises(ProtocolError) as e:
        parse(b"{" + b" " * 2000 + b"}", limit=1024, user={"ep-id": "big"}, response_topic="r")
    assert (e.value.code, e.value.job_id) == ("too_large", "big")


def test_3_1_1_error_goes_to_reply_to():
    with pytest.raises(ProtocolError) as e:
        parse(json.dumps({"id": "j", "reply_to": "r/311", "inputs": 5}).encode())
    assert e.value.reply.topic == "r/311" and not e.value.reply.v5


@pytest.mark.parametrize("accept", ["json", "b64", "npy", "npz", "safetensors"])
def test_reply_render_parse_round_trip(accept):
    y = {"logits": np.random.default_rng(2).standard_normal((2, 10)).astype(np.float32)}
    meta = {
        "v": 1,
        "id": "j",
        "device": "d",
        "status": "ok",
        "final": True,
        "timing": {"run_ms": 1},
    }
    reply = ok_reply(meta, y, accept)
    for addr in (ReplyAddress("t", b"c", None, True), ReplyAddress("t", None, "k", False)):
        payload, ctype, user = render(reply, addr, dup=True)
        props = Props(content_type=ctype if addr.v5 else None, user=dict(user) if addr.v5 else {})
        r = parse_reply(payload, props)
        assert r.id == "j" and r.status == "ok" and r.final and r.meta["dup"] is True
        assert r.meta["timing"] == {"run_ms": 1}
        assert np.array_equal(r.outputs["logits"], y["logits"])
        if not addr.v5:
            assert ctype == codec.CT_JSON and r.meta["correlation"] == "k"
    err = Reply({"id": "j"} | error_meta("busy", "full", retry_after_ms=20))
    r = parse_reply(render(err, ReplyAddress("t"))[0], Props())
    assert r.meta["error"] == {"code": "busy", "message": "full", "retryable": True}
    assert r.meta["retry_after_ms"] == 20


# --- scheduler ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_b4(tmp_path_factory):
    return pack(DATA / "digits_cnn.onnx", tmp_path_factory.mktemp("b4") / "d4.epk",
                input_shapes={"image": (4, 1, 8, 8)})  # fmt: skip


class Harness:
    """A Scheduler over two arenas of ``session``, recording what it reports."""

    def __init__(self, session, **kw) -> None:
        from edgepack.runtime.executor import Executor

        self.done, self.failed, self.refused = {}, {}, {}
        self.expected = 0
        self._ev = threading.Event()
        executors = [session.executor, Executor(session.manifest, session.bundle.weights)]
        self.s = Scheduler(
            executors,
            on_done=lambda j: self._record(self.done, j.id, dict(j.outputs)),
            on_fail=lambda j, c, m: self._record(self.failed, j.id, c),
            **kw,
        )

    def _record(self, d, k, v) -> None:
        d[k] = v
        if len(self.done) + len(self.failed) + len(self.refused) >= self.expected:
            self._ev.set()

    def run(self, jobs: list[Job]) -> None:
        self.expected = len(jobs)
        if not jobs:
            self._ev.set()
        for j in jobs:
            r = self.s.submit(j)
            if r:
                self._record(self.refused, j.id, r)
        assert self._ev.wait(30)
        assert self.s.close(5) == []


def test_batched_scheduler_matches_session_row_by_row(digits_b4):
    import train_digits
    from edgepack.runtime.session import Session

    _, X, _, _ = train_digits.load_split()
    sess = Session(digits_b4, threads=1)
    h = Harness(sess, max_wait_s=0.005)
    sizes = [1, 3, 4, 6, 1, 9, 2, 1]
    jobs, start = [], 0
    for i, n in enumerate(sizes):
        feeds, rows = h.s.prepare({"image": X[start : start + n]})
        jobs.append(Job(f"j{i}", feeds, rows, None, False, time.monotonic()))
        start += n
    h.run(jobs)
    assert not h.failed and h.s.rows_run >= 27 and h.s.batches >= 7  # at most 4 rows a run
    start = 0
    for i, n in enumerate(sizes):
        for r in range(n):
            z = np.zeros((4, 1, 8, 8), np.float32)
            z[0] = X[start + r]
            want = sess.executor.run({"image": z})["logits"][0]
            assert np.array_equal(h.done[f"j{i}"]["logits"][r], want)  # bit-exact, any slot
        start += n


def test_scheduler_rejects_bad_shapes(digits_b4):
    from edgepack.runtime.serve.sched import BadInput
    from edgepack.runtime.session import Session

    h = Harness(Session(digits_b4, threads=1))
    for feeds in (
        {"image": np.zeros((1, 8, 8), np.float32)},
        {"image": np.zeros((0, 1, 8, 8), np.float32)},
        {"image": np.zeros((1, 1, 8, 8), np.float64)},
        {"img": np.zeros((1, 1, 8, 8), np.float32)},
    ):
        with pytest.raises(BadInput, match="expected: image f32"):
            h.s.prepare(feeds)
    h.run([])


def test_scheduler_deadline_and_queue_bound(digits_b4):
    from edgepack.runtime.session import Session

    h = Harness(Session(digits_b4, threads=1), max_jobs=8, max_wait_s=0.05)
    x = np.zeros((1, 1, 8, 8), np.float32)
    past = time.monotonic() - 1
    jobs = [Job("late", [x], 1, past, False, past)] + [
        Job(f"j{i}", [x], 1, None, False, time.monotonic()) for i in range(40)
    ]
    h.run(jobs)
    assert h.failed["late"] == "deadline_exceeded"
    assert "busy" in h.refused.values() and len(h.done) >= 7


def test_reply_store_dedups_and_forgets_transient_errors():
    st = ReplyStore(max_entries=2, ttl_s=60)
    a, b = ReplyAddress("t/a", b"1"), ReplyAddress("t/b", b"2")
    assert st.claim("j", a) == ("new", [])
    part = Reply({"status": "partial"})
    assert st.add("j", part) == [a]
    state, so_far = st.claim("j", b)  # a retry while running joins the job
    assert state == "pending" and so_far == [part]
    final = Reply({"status": "ok"})
    assert st.finish("j", final) == [a, b]
    assert st.claim("j", a) == ("done", [part, final])
    st.claim("busy", a)
    st.finish("busy", Reply({"status": "error"}), keep=False)
    assert st.claim("busy", a)[0] == "new"  # a transient error is not remembered
    for k in ("x", "y", "z"):
        st.claim(k, a)
        st.finish(k, final)
    assert len(st) == 2 and st.claim("j", a)[0] == "new"  # oldest evicted


def test_packed_properties_read_back_by_paho():
    from edgepack.runtime.serve.conn import PackedProps
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    user = [("ep-id", "j1"), ("ep-meta", json.dumps({"é": "ü" * 300}))]
    pp = PackedProps("application/x-npy", b"\x00corr", "r/t", user, 30)
    p, n = Properties(PacketTypes.PUBLISH).unpack(pp.pack())
    assert n == len(pp.pack())
    assert (p.ContentType, p.CorrelationData, p.ResponseTopic) == (
        "application/x-npy",
        b"\x00corr",
        "r/t",
    )
    assert p.MessageExpiryInterval == 30 and p.UserProperty == user


def test_client_stream_parts_are_delivered_once_per_row():
    """Parts re-sent by a retry, even cut differently by another agent, yield only the
    rows not seen yet."""
    from edgepack.client import Job

    job = Job(None, "j", "t", rows=10, stream=True)
    y = np.arange(10, dtype=np.float32)[:, None]
    assert job._on_partial((0, 4), {"y": y[0:4]}, "a")
    assert not job._on_partial((0, 4), {"y": y[0:4]}, "a")  # same part again
    assert job._on_partial((2, 6), {"y": y[2:6]}, "b")  # overlaps: only rows 4, 5 are new
    assert job._on_partial((6, 10), {"y": y[6:10]}, "b")
    assert job._stream_complete()
    job._finish(job._stream_out)
    parts = list(job.parts(timeout=1))
    assert [p.rows for p in parts] == [(0, 4), (4, 6), (6, 10)]
    assert np.array_equal(np.concatenate([p.outputs["y"] for p in parts]), y)
    assert np.array_equal(job.result()["y"], y)
