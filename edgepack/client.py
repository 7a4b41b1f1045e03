"""Send inference jobs to edgepack agents over MQTT (docs/protocol.md), and ``submit``.

    from edgepack.client import Client

    with Client("mqtt://127.0.0.1:1883") as c:
        y = c.infer({"image": x}, model="digits")  # any agent of the fleet
        y = c.infer(x, device="cam-3", timeout=5)   # one device; a bare array: its one input
        for part in c.stream({"image": xs}, model="digits"):  # rows as they are done
            print(part.rows, part.outputs["logits"].argmax(1))

A job keeps its id across attempts: when no answer comes within ``retry_after``
seconds (or the agent says busy / shutting down), the same job is sent again, and
agents answer a known id from memory instead of running it twice. Whatever arrives,
the caller sees each job's answer (and each streamed row) exactly once.
"""

from __future__ import annotations

import hashlib
import math
import queue
import random
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .runtime.serve.codec import (
    CT_JSON,
    CodecError,
    encode_binary,
    tensor_to_json,
)

if TYPE_CHECKING:
    from .runtime.serve.conn import BrokerConfig
from .runtime.serve.protocol import (
    DEFAULT_PREFIX,
    NAME_RE,
    UP_ACCEPT,
    UP_ID,
    UP_STREAM,
    UP_TIMEOUT,
    Props,
    blob_topic,
    device_jobs_topic,
    model_jobs_topic,
    parse_reply,
    reply_topic,
    status_topic,
)

ENCODINGS = ("safetensors", "npz", "npy", "json", "b64")
_REF_CHUNK_OVERHEAD = 1024  # topic, properties and fixed header of one chunk message


class JobError(Exception):
    """The job failed: an error reply (``code`` from docs/protocol.md), a refused
    publish (``not_authorized``) or no answer in time (``JobTimeout``)."""

    def __init__(self, job_id: str, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"job {job_id}: {code}: {message}")
        self.job_id, self.code, self.message, self.retryable = job_id, code, message, retryable


class JobTimeout(JobError):
    pass


@dataclass
class Part:
    """Rows ``rows[0]:rows[1]`` of a streamed job's outputs."""

    rows: tuple[int, int]
    outputs: dict[str, np.ndarray]
    device: str | None


class Job:
    """A submitted job. ``result()`` blocks for the outputs; ``parts()`` follows a
    stream. Both raise JobError / JobTimeout."""

    def __init__(
        self,
        client: Client,
        job_id: str,
        topic: str,
        rows: int,
        stream: bool,
        to_device: bool = True,
    ) -> None:
        self.id, self.topic, self.rows, self.stream = job_id, topic, rows, stream
        self.to_device = to_device  # sent to one device's topic (else to a fleet)
        self.device: str | None = None  # the agent that answered
        self.attempts = 0
        self.meta: dict = {}  # the final reply's envelope (timing, rows...)
        self._client = client
        self._cv = threading.Condition()
        self._done = False
        self._error: JobError | None = None
        self._outputs: dict[str, np.ndarray] | None = None
        self._covered = np.zeros(max(rows, 1), bool)
        self._parts: queue.Queue[Part | None] = queue.Queue()
        self._stream_out: dict[str, np.ndarray] = {}

    # --- caller side ------------------------------------------------------------------

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        with self._cv:
            if not self._cv.wait_for(lambda: self._done, timeout):
                raise JobTimeout(self.id, "timeout", f"no answer within {timeout:g} s (waiting)")
        if self._error is not None:
            raise self._error
        return self._outputs

    def parts(self, timeout: float | None = None) -> Iterator[Part]:
        """Each streamed row range once, in arrival order, then returns (or raises)."""
        while True:
            try:
                p = self._parts.get(timeout=timeout)
            except queue.Empty:
                raise JobTimeout(self.id, "timeout", "no stream part in time") from None
            if p is None:
                if self._error is not None:
                    raise self._error
                return
            yield p

    # --- client side (paho thread / retry thread) ---------------------------------------

    def _finish(self, outputs=None, error: JobError | None = None) -> bool:
        with self._cv:
            if self._done:
                return False
            self._done, self._outputs, self._error = True, outputs, error
            self._cv.notify_all()
        self._parts.put(None)
        return True

    def _on_partial(self, rows: tuple[int, int], outputs: dict, device: str | None) -> bool:
        """Yield only rows not seen before (a retry that another agent ran may cover
        them again, possibly cut differently). Returns False for a pure duplicate."""
        a, b = rows
        if not 0 <= a < b <= self.rows or self._done:
            return False
        with self._cv:
            new = ~self._covered[a:b]
            if not new.any():
                return False
            for name, v in outputs.items():
                buf = self._stream_out.get(name)
                if buf is None:
                    buf = self._stream_out[name] = np.empty((self.rows, *v.shape[1:]), v.dtype)
                buf[a:b][new] = v[new]
            self._covered[a:b] = True
        idx = np.flatnonzero(new)
        for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):  # contiguous runs
            s, e = int(run[0]), int(run[-1]) + 1
            self._parts.put(Part((a + s, a + e), {k: v[s:e] for k, v in outputs.items()}, device))
        return True

    def _stream_complete(self) -> bool:
        return bool(self._covered.all())


@dataclass
class _Pending:
    job: Job
    payload: bytes
    ctype: str
    user: list
    deadline: float  # monotonic: give up here
    retry_after: float
    retries_left: int
    next_try: float
    blob: list[str] | None = None  # retained chunk topics to clear when done
    why: str | None = None  # what a timeout error should say instead of "no answer"
    free_retry: bool = False  # next resend answers a busy reply: not counted in retries


class Client:
    def __init__(
        self,
        broker: str | BrokerConfig,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        password_file: str | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        insecure: bool = False,
        prefix: str = DEFAULT_PREFIX,
        encoding: str = "safetensors",
        max_message: int | None = None,
        connect_timeout: float = 10.0,
        session_expiry: int = 300,
    ) -> None:
        """``broker``: a URL plus the credential/TLS keywords, or a ready ``BrokerConfig``
        (whose settings then win). ``max_message``: send inputs larger than this by
        reference (default: the broker's maximum packet size from its CONNACK, if it
        announces one)."""
        from .runtime.serve.conn import BrokerConfig, Connection

        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}")
        self.cfg = (
            broker
            if isinstance(broker, BrokerConfig)
            else BrokerConfig.from_url(
                broker,
                username=username,
                password=password,
                password_file=password_file,
                ca=ca,
                cert=cert,
                key=key,
                insecure=insecure,
            )
        )
        self.client_id = client_id or f"ep-client-{uuid.uuid4().hex[:12]}"
        self.prefix = prefix.rstrip("/")
        self.encoding = encoding
        self.max_message = max_message
        self.owner = self.cfg.username or self.client_id  # ACLs match %u (or %c)
        self.reply_topic = (
            f"{reply_topic(self.prefix, self.cfg.username)}/{self.client_id}"
            if self.cfg.username
            else reply_topic(self.prefix, self.client_id)
        )
        self.stats: Counter[str] = Counter()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._mids: OrderedDict[int, str] = OrderedDict()
        self._publish_problems: deque[tuple[int, int, str, float]] = deque()
        self._watch: dict[str, queue.Queue] = {}
        self._closed = False
        self.conn = Connection(
            self.cfg,
            self.client_id,
            session_expiry=session_expiry,
            clean_start=True,
            subscriptions=lambda: [(self.reply_topic, 1)] + [(t, 1) for t in self._watch],
            on_message=self._on_message,
            on_publish_failed=self._on_publish_failed,
            name="client",
        )
        self.conn.start(connect_timeout, retry=False)
        # Later reconnects resume the session: answers sent meanwhile are kept for us.
        self.conn.client._clean_start = False
        self._thread = threading.Thread(
            target=self._retry_loop, name="edgepack-client", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Disconnect and end the session (no answers are kept for us afterwards)."""
        if self._closed:
            return
        self._closed = True
        with self._wake:
            self._wake.notify_all()
        self._thread.join(timeout=2)
        self.conn.stop(session_expiry=0)

    # --- jobs ---------------------------------------------------------------------------

    def submit(
        self,
        inputs: Mapping[str, np.ndarray] | np.ndarray,
        *,
        device: str | None = None,
        model: str | None = None,
        job_id: str | None = None,
        timeout: float = 10.0,
        retry_after: float | None = None,
        retries: int = 3,
        stream: bool = False,
        accept: str | None = None,
        encoding: str | None = None,
    ) -> Job:
        """Send a job to ``device`` or to the fleet of ``model``; returns at once.

        ``timeout``: total seconds until the job fails with JobTimeout (also sent to
        the agent, which then skips the job rather than answer late). ``retry_after``:
        resend when no answer came within this many seconds (default
        ``timeout / (retries + 1)``, at least 0.5). ``retries``: how many resends.
        ``inputs``: arrays keyed by input name, or one bare array for a one-input model.
        """
        if (device is None) == (model is None):
            raise ValueError("give exactly one of device= and model=")
        name = device if device is not None else model
        if not NAME_RE.match(name):
            raise ValueError(f"bad device/model name {name!r}")
        topic = (
            device_jobs_topic(self.prefix, device)
            if device is not None
            else model_jobs_topic(self.prefix, model)
        )
        job_id = job_id or uuid.uuid4().hex
        enc = encoding or self.encoding
        rows = _rows(inputs)
        payload, ctype, user = self._encode(job_id, inputs, enc, stream, accept)
        job = Job(self, job_id, topic, rows, stream, to_device=device is not None)
        now = time.monotonic()
        ra = retry_after if retry_after is not None else max(0.5, timeout / (retries + 1))
        # next_try is set by _send: until then the retry thread must leave it alone
        p = _Pending(job, payload, ctype, user, now + timeout, ra, retries, math.inf)
        limit = self._message_limit()
        if limit is not None and len(payload) + _REF_CHUNK_OVERHEAD > limit:
            self._by_reference(p, limit, timeout)
        with self._lock:
            if job_id in self._pending:
                raise ValueError(f"job {job_id} is already pending")
            self._pending[job_id] = p
        self._send(p)
        return job

    def infer(self, inputs, **kw) -> dict[str, np.ndarray]:
        """``submit`` and wait for the outputs."""
        return self.submit(inputs, **kw).result()

    def stream(self, inputs, **kw) -> Iterator[Part]:
        """``submit(stream=True)`` and yield each row range as the agent finishes it."""
        return self.submit(inputs, stream=True, **kw).parts()

    def status(self, device: str, timeout: float = 2.0) -> dict | None:
        """The device's retained status (state, model, inputs...), or None."""
        import json

        topic = status_topic(self.prefix, device)
        q: queue.Queue = queue.Queue()
        self._watch[topic] = q
        self.conn.subscribe(topic, 1)
        try:
            payload = q.get(timeout=timeout)
            return json.loads(payload) if payload else None
        except queue.Empty:
            return None
        finally:
            self._watch.pop(topic, None)
            self.conn.unsubscribe(topic)

    # --- encoding -----------------------------------------------------------------------

    def _encode(self, job_id, inputs, enc, stream, accept) -> tuple[bytes, str, list]:
        import json

        user = [(UP_ID, job_id)]  # (ep-v omitted: 1 is the default; fewer properties)
        if stream:
            user.append((UP_STREAM, "1"))
        if accept:
            user.append((UP_ACCEPT, accept))
        bare = isinstance(inputs, np.ndarray)
        if enc in ("json", "b64"):
            body: dict = {"v": 1, "id": job_id}
            if bare:
                if enc == "b64":
                    raise ValueError("b64 needs inputs keyed by name")
                body["inputs"] = inputs.tolist()
            else:
                body["inputs"] = {
                    k: tensor_to_json(np.asarray(v), enc == "b64") for k, v in inputs.items()
                }
            return json.dumps(body, separators=(",", ":")).encode(), CT_JSON, user
        if bare:
            data, ctype = encode_binary({"x": inputs}, "npy")
        else:
            data, ctype = encode_binary({k: np.asarray(v) for k, v in inputs.items()}, enc)
        return data, ctype, user

    def _message_limit(self) -> int | None:
        limits = [x for x in (self.max_message, self.conn.max_packet) if x]
        return min(limits) if limits else None

    def _by_reference(self, p: _Pending, limit: int, timeout: float) -> None:
        """Publish the payload as retained chunks (expiring) and send a small job that
        points at them."""
        import json

        job = p.job
        blob_id = hashlib.sha256(f"{self.client_id}/{job.id}".encode()).hexdigest()[:24]
        base = blob_topic(self.prefix, self.owner, blob_id)
        size = limit - _REF_CHUNK_OVERHEAD
        chunks = [p.payload[i : i + size] for i in range(0, len(p.payload), size)]
        expiry = int(math.ceil(timeout)) + 60
        topics = []
        for i, c in enumerate(chunks):
            t = f"{base}/{i}"
            self.conn.publish(t, c, retain=True, expiry=expiry)
            topics.append(t)
        ref = {
            "topic": base,
            "parts": len(chunks),
            "bytes": len(p.payload),
            "sha256": hashlib.sha256(p.payload).hexdigest(),
            "content_type": p.ctype,
        }
        body = {"v": 1, "id": job.id, "ref": ref}
        p.payload = json.dumps(body, separators=(",", ":")).encode()
        p.ctype, p.blob = CT_JSON, topics
        self.stats["by_reference"] += 1

    # --- sending and retrying -------------------------------------------------------------

    def _send(self, p: _Pending) -> None:
        now = time.monotonic()
        left_ms = max(1, int((p.deadline - now) * 1e3))
        user = p.user + [(UP_TIMEOUT, str(left_ms))]
        info = self.conn.publish(
            p.job.topic,
            p.payload,
            content_type=p.ctype,
            correlation=p.job.id.encode(),
            response_topic=self.reply_topic,
            user=user,
            # Only a device job can wait in the broker (for an offline device); a fleet
            # job goes to a live agent or nowhere. Every property costs the receiver.
            expiry=int(math.ceil(left_ms / 1e3)) if p.job.to_device else None,
        )
        with self._lock:
            self._mids[info.mid] = p.job.id
            while len(self._mids) > 65536:
                self._mids.popitem(last=False)
            p.job.attempts += 1
            # Back off when answers are slow (an overloaded fleet must not be flooded
            # with copies): 1, 2, 4, 8 x retry_after, jittered so retries spread out.
            backoff = p.retry_after * min(8, 2 ** (p.job.attempts - 1))
            p.next_try = now + backoff * (0.8 + 0.4 * random.random())
        self.stats["sent" if p.job.attempts == 1 else "resent"] += 1

    def _retry_loop(self) -> None:
        while not self._closed:
            resend, expired = [], []
            with self._wake:
                refused = self._apply_publish_problems()
                now = time.monotonic()
                nxt = now + 0.1
                for p in self._pending.values():
                    if now >= p.deadline:
                        expired.append(p)
                    elif now >= p.next_try:
                        if p.free_retry or p.retries_left > 0:
                            if not p.free_retry:
                                p.retries_left -= 1
                            p.free_retry = False
                            resend.append(p)
                            p.next_try = math.inf  # _send sets it
                        else:
                            p.next_try = p.deadline
                    nxt = min(nxt, p.next_try, p.deadline)
                for p in expired:
                    self._pending.pop(p.job.id, None)
                if not resend and not expired and not refused:
                    self._wake.wait(max(0.001, nxt - now))
            for p, err in refused:
                self._conclude(p, error=err)
            for p in expired:
                n = p.job.attempts
                why = (
                    getattr(p, "why", None) or f"no answer within the timeout after {n} attempt(s)"
                )
                self._conclude(p, error=JobTimeout(p.job.id, "timeout", why, True))
            for p in resend:
                if not self._closed and not p.job.done():
                    self._send(p)

    def _apply_publish_problems(self) -> list[tuple[_Pending, JobError]]:
        """Under self._lock. Returns the jobs to fail (outside the lock)."""
        keep, fail = [], []
        while self._publish_problems:
            mid, code, reason, t = self._publish_problems.popleft()
            job_id = self._mids.get(mid)
            if job_id is None:
                if time.monotonic() - t < 1.0:  # the PUBACK beat _send's bookkeeping
                    keep.append((mid, code, reason, t))
                continue
            p = self._pending.get(job_id)
            if p is None:
                continue
            if code == 16:  # nobody subscribed (agents down or reconnecting): retry soon
                p.why = f"no agent is subscribed to {p.job.topic}"
                p.next_try = min(p.next_try, time.monotonic() + min(1.0, p.retry_after))
                self.stats["no_subscribers"] += 1
            else:
                self._pending.pop(job_id, None)
                msg = f"broker refused the job on {p.job.topic}: {reason}"
                fail.append((p, JobError(job_id, "not_authorized", msg)))
        self._publish_problems.extend(keep)
        return fail

    def _on_publish_failed(self, mid: int, reason: str, code: int) -> None:
        # paho's network thread, inside its own locks: record only.
        self._publish_problems.append((mid, code, reason, time.monotonic()))

    def _conclude(self, p: _Pending, outputs=None, error: JobError | None = None) -> None:
        if p.job._finish(outputs, error):
            self.stats["failed" if error else "answered"] += 1
        if p.blob:
            for t in p.blob:  # clear the retained chunks
                self.conn.publish(t, b"", retain=True)

    # --- replies (paho network thread) ------------------------------------------------------

    def _on_message(self, msg) -> None:
        from .runtime.serve.conn import props_of

        w = self._watch.get(msg.topic)
        if w is not None:
            w.put(msg.payload)
            return
        rt, corr, ctype, user, _ = props_of(msg)
        if corr is not None:
            with self._lock:
                known = corr.decode("utf-8", "replace") in self._pending
            if not known:  # a late copy for a job already answered: do not even decode it
                self.stats["duplicates"] += 1
                return
        try:
            r = parse_reply(msg.payload, Props(rt, corr, ctype, user))
        except (CodecError, ValueError, KeyError):
            self.stats["unreadable"] += 1
            return
        job_id = corr.decode("utf-8", "replace") if corr else r.id
        with self._lock:
            p = self._pending.get(job_id)
        if p is None:
            self.stats["duplicates"] += 1  # an answer to a job already answered
            return
        job = p.job
        device = r.meta.get("device")
        if r.status == "partial":
            rows = tuple(r.meta.get("rows") or (0, job.rows))
            if not job._on_partial(rows, r.outputs or {}, device):
                self.stats["duplicates"] += 1
            return
        if r.status == "error":
            err = r.meta.get("error") or {}
            code, message = err.get("code", "internal"), err.get("message", "")
            if err.get("retryable") and code != "deadline_exceeded":
                self._retry_soon(p, r.meta.get("retry_after_ms"))
                return
            with self._lock:
                self._pending.pop(job_id, None)
            job.meta, job.device = r.meta, device
            self._conclude(p, error=JobError(job_id, code, message))
            return
        if job.stream and not job._stream_complete():
            # The final arrived without all rows (our session lost some): ask again;
            # the agent re-sends everything it stored.
            self._retry_soon(p, 0)
            return
        with self._lock:
            self._pending.pop(job_id, None)
        job.meta, job.device = r.meta, device
        outputs = job._stream_out if job.stream else r.outputs
        self._conclude(p, outputs=outputs)

    def _retry_soon(self, p: _Pending, hint_ms) -> None:
        """A retryable error: resend after the agent's hint or a jittered backoff."""
        self.stats["retryable_errors"] += 1
        delay = (hint_ms / 1e3) if isinstance(hint_ms, (int, float)) else 0.05
        delay = min(delay, p.retry_after) * (0.5 + random.random())
        with self._wake:
            p.next_try = time.monotonic() + delay
            p.free_retry = True  # busy is an answer, not a loss: bounded by the timeout only
            self._wake.notify()


def _rows(inputs) -> int:
    a = inputs if isinstance(inputs, np.ndarray) else next(iter(inputs.values()), None)
    a = np.asarray(a)
    return int(a.shape[0]) if a.ndim else 1


# --- edgepack submit ----------------------------------------------------------------------


def add_submit_arguments(p) -> None:
    from .runtime.serve.cli import add_broker_arguments

    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--device", help="send to this device's job topic")
    to.add_argument("--model", help="send to the fleet of agents serving this model")
    p.add_argument(
        "--input",
        "-i",
        required=True,
        help=".npy for a single-input model, or .npz keyed by input name",
    )
    p.add_argument("--output", "-o", help="write the outputs to this .npz instead of a summary")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds until giving up (default 10)"
    )
    p.add_argument("--retries", type=int, default=3, help="resends of the same job id (default 3)")
    p.add_argument(
        "--retry-after", type=float, help="resend after this many seconds without an answer"
    )
    p.add_argument(
        "--job-id", help="job id (default: a random UUID); re-using one returns the stored answer"
    )
    p.add_argument(
        "--stream", action="store_true", help="print row ranges as the agent finishes them"
    )
    p.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default="safetensors",
        help="payload encoding (default safetensors)",
    )
    add_broker_arguments(p)


def cmd_submit(a) -> int:
    import os
    import sys

    from .runtime.cli_io import emit_outputs
    from .runtime.serve.conn import ConnectError

    if not os.path.exists(a.input):
        raise FileNotFoundError(f"--input {a.input}: no such file")
    if a.input.endswith(".npz"):
        with np.load(a.input) as z:
            inputs: object = {k: z[k] for k in z.files}
    elif a.input.endswith(".npy"):
        inputs = np.load(a.input)
    else:
        raise ValueError(f"--input {a.input}: expected a .npy or .npz file")
    encoding = a.encoding
    if isinstance(inputs, np.ndarray) and encoding in ("safetensors", "npz", "b64"):
        encoding = "npy"  # one unnamed array: the agent maps it to the model's one input
    from .runtime.serve.cli import broker_config

    cfg = broker_config(a)  # validates the options before connecting
    try:
        client = Client(cfg, prefix=a.prefix, encoding=encoding)
    except ConnectError as e:
        print(f"edgepack: error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    try:
        with client:
            job = client.submit(
                inputs,
                device=a.device,
                model=a.model,
                job_id=a.job_id,
                timeout=a.timeout,
                retries=a.retries,
                retry_after=a.retry_after,
                stream=a.stream,
            )
            if a.stream:
                for part in job.parts():
                    print(f"rows {part.rows[0]}-{part.rows[1]} from {part.device}", flush=True)
            outs = job.result()
    except JobError as e:
        print(f"edgepack: error: {e}", file=sys.stderr)
        return 1
    ms = (time.perf_counter() - t0) * 1e3
    print(f"job {job.id}: answered by {job.device} in {ms:.1f} ms ({job.attempts} attempt(s))")
    emit_outputs(outs, a.output)
    return 0


__all__ = ["Client", "Job", "JobError", "JobTimeout", "Part"]
