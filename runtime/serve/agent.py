"""``edgepack serve``: a device agent that takes inference jobs over MQTT.

Two broker connections (docs/protocol.md, "Sessions"):

- the *device* connection (client id = device id) keeps a persistent session
  (``--session-expiry``): jobs sent to ``<prefix>/dev/<device>/jobs`` while the agent
  is down wait in the broker for it. It carries the retained status, its last will
  ("offline"), metrics and every reply.
- the *fleet* connection (client id ``<device>.fleet``) holds the shared subscription
  ``$share/<group>/<prefix>/model/<model>/jobs`` with session expiry 0. Mosquitto
  keeps routing a shared subscription's share of jobs to a dead member whose session
  lives on (and loses the QoS 1 messages it held when the session ends), so a crashed
  agent must leave the group at once: its unanswered jobs are then re-sent by clients
  (same job id) and land on the live members.

Every message is decoded on paho's network thread, de-duplicated by job id
(``ReplyStore``), checked against the model, and queued (``Scheduler``); workers run
batches and publish the replies. (A sub-millisecond job that finds nothing queued runs
on the network thread itself: thread hand-offs are most of the latency otherwise.)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ... import __version__
from .blobs import BlobFetcher
from .codec import CodecError
from .conn import BrokerConfig, Connection, props_of
from .generation import EngineBusy, GenSequence
from .protocol import (
    PROTOCOL_VERSION,
    RETRYABLE,
    JobRequest,
    Props,
    ProtocolError,
    Reply,
    ReplyAddress,
    decode_feeds,
    device_jobs_topic,
    error_meta,
    metrics_topic,
    model_jobs_topic,
    ok_reply,
    parse_job,
    peek_job_id,
    render,
    reply_address,
    shared_subscription,
    status_topic,
)
from .sched import BadInput, Job
from .service import LLMService, Service
from .store import ReplyStore

log = logging.getLogger("edgepack.agent")


@dataclass
class AgentConfig:
    broker: BrokerConfig
    device: str
    model: str
    group: str = "fleet"
    fleet: bool = True
    prefix: str = "edgepack/v1"
    session_expiry: int = 3600
    fleet_session_expiry: int = 0
    metrics_interval: float = 10.0
    dedup_ttl: float = 600.0
    dedup_entries: int = 10_000
    dedup_bytes: int = 64 << 20
    blob_timeout: float = 30.0
    connect_timeout: float | None = None  # None: wait for the broker forever


class Agent:
    """The MQTT front of a ``Service`` (its scheduler, limits and metrics)."""

    def __init__(self, service: Service, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.service = service
        self.llm = isinstance(service, LLMService)  # generation jobs, not tensor jobs
        self.session = None if self.llm else service.session
        self.sched = None if self.llm else service.sched
        self.input_dtypes = {} if self.llm else service.input_dtypes
        self._gens: dict[str, GenSequence] = {}  # running generation jobs by id (cancels)
        self.store = ReplyStore(cfg.dedup_entries, cfg.dedup_bytes, cfg.dedup_ttl)
        self.metrics = service.metrics
        self.draining = False
        self.started = False
        # (connection, mid) -> (job id, topic), to name the job when a reply is refused
        self._reply_mids: OrderedDict[tuple[str, int], tuple[str, str]] = OrderedDict()
        self._mid_lock = threading.Lock()
        p, d = cfg.prefix, cfg.device
        self.jobs_topic = device_jobs_topic(p, d)
        self.fleet_sub = shared_subscription(p, cfg.group, cfg.model)
        self.status_topic = status_topic(p, d)
        self.blobs = BlobFetcher(
            lambda t: self.dev.subscribe(t, 1),
            lambda t: self.dev.unsubscribe(t),
            timeout_s=cfg.blob_timeout,
        )
        self.dev = Connection(
            cfg.broker,
            d,
            session_expiry=cfg.session_expiry,
            clean_start=False,
            subscriptions=lambda: [(self.jobs_topic, 1)] + [(t, 1) for t in self.blobs.topics()],
            on_message=lambda m: self._on_message(m, self.dev),
            on_ready=self._on_dev_ready,
            on_publish_failed=lambda mid, why, code: self._on_publish_failed(
                "device", mid, why, code
            ),
            will=(self.status_topic, self._status_payload("offline", "connection lost")),
            name="device",
        )
        self.fleet = (
            Connection(
                cfg.broker,
                f"{d}.fleet",
                session_expiry=cfg.fleet_session_expiry,
                clean_start=True,
                subscriptions=lambda: [] if self.draining else [(self.fleet_sub, 1)],
                on_message=lambda m: self._on_message(m, self.fleet),
                on_publish_failed=lambda mid, why, code: self._on_publish_failed(
                    "fleet", mid, why, code
                ),
                name="fleet",
            )
            if cfg.fleet
            else None
        )

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Connect both sessions, subscribe, then publish the retained "online" status."""
        log.info(
            "device %s: model %s (%s), broker %s",
            self.cfg.device,
            self.cfg.model,
            self._shape_summary(),
            self.cfg.broker.describe(),
        )
        self.dev.start(self.cfg.connect_timeout)
        try:
            if self.fleet is not None:
                self.fleet.start(self.cfg.connect_timeout)
        except Exception:
            self.dev.stop()
            raise
        # Everything loaded so far (numba, llvmlite, the bundle: ~50k objects) lives as
        # long as the process; a full GC pass over it takes ~50 ms, a latency spike
        # every time it runs. Frozen objects are never scanned again.
        gc.collect()
        gc.freeze()
        self.started = True
        # Logged before "online" goes out: whoever sees the status may read the log.
        log.info(
            "serving: jobs on %s%s; status on %s",
            self.jobs_topic,
            f" and {self.fleet_sub}" if self.fleet else "",
            self.status_topic,
        )
        self._publish_status("online")

    def serve_forever(self, stop: threading.Event) -> None:
        """Publish metrics and expire stale state until ``stop`` is set."""
        next_metrics = time.monotonic() + self.cfg.metrics_interval
        while not stop.wait(0.2):
            self.blobs.expire()
            self.store.expire()
            if self.cfg.metrics_interval > 0 and time.monotonic() >= next_metrics:
                self.publish_metrics()
                next_metrics = time.monotonic() + self.cfg.metrics_interval

    def shutdown(self) -> None:
        """Leave the fleet, answer every accepted job (or tell its caller we are
        shutting down), publish "offline", disconnect cleanly."""
        log.info("shutting down: leaving the fleet, draining %d job(s)", self._depth())
        self.draining = True
        self._publish_status("draining")
        if self.fleet is not None:
            # After the UNSUBACK no new fleet job comes to us; everything the broker
            # sent before it has been queued (TCP keeps order).
            self.fleet.unsubscribe(self.fleet_sub, wait=5.0)
            self.fleet.stop()
        self.service.close()  # answers what it cannot finish with shutting_down
        self.blobs.expire(now=float("inf"), code="shutting_down")
        self.publish_metrics()
        self._publish_status("offline", "shutdown")
        self.dev.stop()  # the session (and the jobs sent to this device) stays
        m = self.metrics.counts
        log.info(
            "stopped: %d received, %d answered ok, %d errors, %d duplicates",
            m["received"],
            m["ok"],
            m["error"],
            m["duplicate"],
        )

    # --- status and metrics -------------------------------------------------------------

    def _shape_summary(self) -> str:
        if self.llm:
            e = self.service.engine
            return f"language model, context {e.ctx}, {e.slots} sequence(s) at once"
        b = self.sched.batch
        return f"{self.sched.expected()}, batches of {b} row(s)" if b else self.sched.expected()

    def _depth(self) -> int:
        return self.service.engine.depth if self.llm else self.sched.depth

    def _status_payload(self, state: str, reason: str | None = None) -> bytes:
        s = {
            "v": PROTOCOL_VERSION,
            "device": self.cfg.device,
            "state": state,
            "ts": round(time.time(), 3),
            "model": self.cfg.model,
            "group": self.cfg.group if self.cfg.fleet else None,
            "edgepack": __version__,
            "topics": {
                "jobs": self.jobs_topic,
                "fleet": model_jobs_topic(self.cfg.prefix, self.cfg.model)
                if self.cfg.fleet
                else None,
                "metrics": metrics_topic(self.cfg.prefix, self.cfg.device),
            },
            "inputs": [] if self.llm else self.session.inputs,
            "outputs": [] if self.llm else self.session.outputs,
            "batch_rows": None if self.llm else self.sched.batch,
            "workers": self.service.cfg.workers,
            "max_queue": self.service.cfg.max_queue,
            "max_job_bytes": self.service.cfg.max_job_bytes,
        }
        if self.llm:
            e = self.service.engine
            s["generate"] = {"ctx": e.ctx, "slots": e.slots, "vocab": e.session.vocab}
        if reason:
            s["reason"] = reason
        return json.dumps(s, separators=(",", ":")).encode()

    def _publish_status(self, state: str, reason: str | None = None) -> None:
        self.dev.publish(self.status_topic, self._status_payload(state, reason), retain=True)

    def _on_dev_ready(self, session_present: bool) -> None:
        if self.started:  # a reconnect: the broker may have lost the retained status
            self._publish_status("draining" if self.draining else "online")

    def publish_metrics(self) -> None:
        snap = self.metrics.snapshot(
            device=self.cfg.device,
            queue={"depth": self._depth(), "max": self.service.cfg.max_queue},
            batches=self.service.engine.steps if self.llm else self.sched.batches,
            rows_run=self.service.engine.rows if self.llm else self.sched.rows_run,
            stored_answers=len(self.store),
            reconnects=self.dev.reconnects + (self.fleet.reconnects if self.fleet else 0),
        )
        payload = json.dumps(snap, separators=(",", ":")).encode()
        self.dev.publish(metrics_topic(self.cfg.prefix, self.cfg.device), payload, qos=0)

    # --- incoming jobs (paho network threads) ------------------------------------------

    def _on_message(self, msg, via: Connection) -> None:
        topic = msg.topic
        if topic.startswith(f"{self.cfg.prefix}/blob/"):
            self.blobs.on_chunk(topic, msg.payload)
            return
        self.metrics.inc("received")
        rt, corr, ctype, user, _ = props_of(msg)
        props = Props(rt, corr, ctype, user)
        pid, addr = peek_job_id(props), reply_address(props)
        if addr is not None:
            addr.via = via
        if pid is not None and addr is not None:
            # A re-sent job (same id in the ep-id property) costs no decoding.
            known = self.store.claim_known(pid, addr)
            if known is not None:
                self._answer_known(known[1], addr)
                return
        try:
            req = parse_job(
                msg.payload,
                props,
                limit=self.service.cfg.max_job_bytes,
                input_dtypes=self.input_dtypes,
                prefix=self.cfg.prefix,
            )
        except ProtocolError as e:
            if e.reply is not None:
                e.reply.via = via
            self._reject(e.job_id, e.reply, e.code, e.message, topic)
            return
        if req.reply is not None:
            req.reply.via = via
        if req.cancel:
            self._cancel(req)
            return
        if req.reply is None:
            self.metrics.inc("no_reply")
            log.warning(
                "job %s on %s: no reply address (set ResponseTopic or reply_to); dropped",
                req.id,
                topic,
            )
            return
        state, stored = self.store.claim(req.id, req.reply)
        if state != "new":
            self._answer_known(stored, req.reply)
            return
        if (req.generate is not None) != self.llm:
            what = ("a language model: send 'generate' jobs" if self.llm
                    else "a tensor model: send 'inputs' (generation jobs need a language model)")
            self._finish_error(req, "unsupported", f"this agent serves {what}")
            return
        if req.generate is not None:
            self._admit_generation(req)
            return
        if req.ref is not None:
            refused = self.blobs.start(
                req.ref,
                lambda data, req=req: self._on_blob(req, data),
                lambda code, message, req=req: self._finish_error(req, code, message),
                req.deadline,
            )
            if refused:
                self._finish_error(req, "busy", "too many by-reference inputs being fetched")
            return
        self._admit(req, req.feeds)

    def _answer_known(self, stored: list[Reply], addr: ReplyAddress) -> None:
        """A job id seen before: send what is stored (all of it when answered, the
        stream parts so far when still running; the rest follows)."""
        self.metrics.inc("duplicate")
        for r in stored:
            self._send(r, addr, dup=True)

    def _on_blob(self, req: JobRequest, data: bytes) -> None:
        try:
            feeds = decode_feeds(
                data, req.ref.content_type, self.service.cfg.max_job_bytes, self.input_dtypes
            )
        except (CodecError, ProtocolError) as e:
            code = getattr(e, "code", "malformed")
            self._finish_error(req, code, getattr(e, "message", str(e)))
            return
        self._admit(req, feeds)

    def _admit(self, req: JobRequest, feeds: dict) -> None:
        try:
            arrays, rows = self.sched.prepare(feeds)
        except BadInput as e:
            self._finish_error(req, "bad_input", str(e))
            return
        job = Job(req.id, arrays, rows, req.deadline, req.stream, req.received, ctx=req,
                  front=self)  # fmt: skip
        refused = self.sched.submit(job)
        if refused == "busy":
            self._finish_error(
                req,
                "busy",
                f"queue full ({self.service.cfg.max_queue} jobs); retry later or elsewhere",
                retry_after_ms=self.sched.retry_after_ms(),
            )
        elif refused:
            self._finish_error(req, refused, "the agent is shutting down; retry elsewhere")

    def _reject(
        self, job_id: str | None, addr: ReplyAddress | None, code: str, message: str, topic: str
    ) -> None:
        """An error before the job was claimed (it could not be read): answered, never
        stored, so it does not disturb a valid job with the same id."""
        self.metrics.error(code)
        if addr is None:
            self.metrics.inc("no_reply")
            log.warning(
                "job %s on %s: %s: %s (no reply address; dropped)", job_id, topic, code, message
            )
            return
        log.info("job %s: %s: %s", job_id, code, message)
        self._send(Reply(self._meta(job_id) | error_meta(code, message)), addr)

    # --- generation jobs (language models) --------------------------------------------

    def _admit_generation(self, req: JobRequest) -> None:
        """Check a generation job as the HTTP front checks a completion request (the
        same fields and limits, openai_api.py) and queue it on the engine."""
        from pydantic import ValidationError

        from .openai_api import (
            ChatRequest,
            CompletionRequest,
            GenRequestError,
            prompt_and_limit,
            sampler,
            stops,
        )

        g = {"model": self.cfg.model, **req.generate}
        state = {"seq": 0, "tokens": 0, "text": []}
        try:
            r = (ChatRequest if "messages" in g else CompletionRequest).model_validate(g)
            ids, n = prompt_and_limit(self.service, r)
            seq = GenSequence(req.id, ids, n, sampler(self.service, r),
                              lambda ev, data: self._on_generation(req, state, ev, data),
                              stops(r), deadline=req.deadline, received=req.received,
                              front="mqtt")  # fmt: skip
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            self._finish_error(req, "invalid_job", f"generate.{where}: {first['msg']}"[:500])
            return
        except GenRequestError as e:
            self._finish_error(req, e.code, e.message)
            return
        self._gens[req.id] = seq
        try:
            self.service.engine.submit(seq)
        except EngineBusy as e:
            self._gens.pop(req.id, None)
            say = ("every sequence slot and the queue are full; retry later or elsewhere"
                   if e.code == "busy"
                   else "the agent is shutting down; retry elsewhere")  # fmt: skip
            self._finish_error(req, e.code, say, retry_after_ms=int(e.retry_after_s * 1e3))

    def _on_generation(self, req: JobRequest, state: dict, ev: str, data: dict) -> None:
        """The engine's events of one generation job (engine thread): text pieces as
        ``partial`` messages (``rows``: the tokens they cover) when the job streams,
        then the final answer."""
        if ev == "text":
            if not req.stream:
                state["text"].append(data["text"])
                return
            meta = self._meta(req.id) | {"status": "partial", "final": False,
                                         "seq": state["seq"],
                                         "rows": [state["tokens"], data["tokens"]],
                                         "text": data["text"]}  # fmt: skip
            state["seq"] += 1
            state["tokens"] = data["tokens"]
            reply = Reply(meta)
            self.metrics.inc("partial")
            for addr in self.store.add(req.id, reply):
                self._send(reply, addr)
            return
        self._gens.pop(req.id, None)
        if ev == "error":
            self._finish_error(req, data["code"], data["message"], counted=True)
            return
        meta = self._meta(req.id) | {"status": "ok", "final": True,
                                     "finish_reason": data["finish_reason"],
                                     "usage": data["usage"], "timing": data["timings"]}  # fmt: skip
        if req.stream:
            meta["seq"], meta["parts"] = state["seq"], state["seq"]
        else:
            meta["text"] = "".join(state["text"])
        reply = Reply(meta)
        for addr in self.store.finish(req.id, reply):
            self._send(reply, addr)

    def _cancel(self, req: JobRequest) -> None:
        """A cancel message: the running generation job with that id ends with
        ``cancelled`` (its stream's final message); anything else is ignored."""
        seq = self._gens.get(req.id)
        if seq is None:
            log.info("cancel for job %s: no such generation running here", req.id)
            return
        self.service.engine.cancel(seq)

    # --- answers (worker threads, or the network thread for early errors) ----------------

    def _meta(self, job_id: str | None) -> dict:
        return {
            "v": PROTOCOL_VERSION,
            "id": job_id,
            "device": self.cfg.device,
            "model": self.cfg.model,
        }

    def _finish_error(self, req: JobRequest, code: str, message: str, counted: bool = False,
                      **extra) -> None:  # fmt: skip
        """Answer ``req`` with an error (``counted``: its metric is already counted)."""
        if not counted:
            self.metrics.error(code)
        if code not in ("busy", "shutting_down"):
            log.info("job %s: %s: %s", req.id, code, message)
        reply = Reply(self._meta(req.id) | error_meta(code, message, **extra))
        keep = code not in RETRYABLE and code != "internal"
        for addr in self.store.finish(req.id, reply, keep=keep):
            self._send(reply, addr)

    def on_fail(self, job: Job, code: str, message: str) -> None:
        self._finish_error(job.ctx, code, message)

    def _late(self, job: Job) -> bool:
        if job.deadline is not None and time.monotonic() > job.deadline:
            late = (time.monotonic() - job.deadline) * 1e3
            self.sched.fail(
                job, "deadline_exceeded", f"answer ready {late:.1f} ms after the deadline"
            )
            return True
        return False

    def on_partial(self, job: Job, start: int, stop: int) -> None:
        if self._late(job):
            return
        with job.lock:
            seq = job.seq
            job.seq += 1
        meta = self._meta(job.id) | {
            "status": "partial",
            "final": False,
            "seq": seq,
            "rows": [start, stop],
        }
        reply = ok_reply(meta, {k: v[start:stop] for k, v in job.outputs.items()}, job.ctx.accept)
        self.metrics.inc("partial")
        for addr in self.store.add(job.id, reply):
            self._send(reply, addr)

    def on_done(self, job: Job) -> None:
        if self._late(job):
            return
        now = time.monotonic()
        timing = {
            "queue_ms": round(((job.started or now) - job.received) * 1e3, 3),
            "run_ms": round(job.run_s * 1e3, 3),
            "batch_rows": job.batch,
        }
        meta = self._meta(job.id) | {
            "status": "ok",
            "final": True,
            "nrows": job.rows,
            "timing": timing,
        }
        if job.stream:
            meta["seq"], meta["parts"] = job.seq, job.seq
            reply = ok_reply(meta, None, job.ctx.accept)
        else:
            reply = ok_reply(meta, job.outputs, job.ctx.accept)
        addrs = self.store.finish(job.id, reply)
        for addr in addrs:
            self._send(reply, addr)
        self.metrics.inc("ok")
        self.metrics.latency((time.monotonic() - job.received) * 1e3)

    def _send(self, reply: Reply, addr: ReplyAddress, dup: bool = False) -> None:
        payload, ctype, user = render(reply, addr, dup)
        limit = self.dev.max_packet
        if limit is not None and len(payload) + len(addr.topic) + 512 > limit:
            msg = f"the answer ({len(payload)} B) exceeds the broker's packet limit ({limit} B)"
            payload, ctype, user = render(Reply(reply.meta | error_meta("too_large", msg)), addr)
        # Answer on the connection the job came in on: no hand-off to another network
        # thread. The fleet connection closes first at shutdown; then the device one.
        conn = addr.via if addr.via is not None and not addr.via.closing else self.dev
        info = conn.publish(
            addr.topic, payload, content_type=ctype, correlation=addr.correlation, user=user
        )
        with self._mid_lock:  # workers and network threads both send
            mids = self._reply_mids
            mids[(conn.name, info.mid)] = (str(reply.meta.get("id")), addr.topic)
            while len(mids) > 4096:
                mids.popitem(last=False)

    def _on_publish_failed(self, conn: str, mid: int, reason: str, code: int) -> None:
        # paho's network thread, inside paho's own lock: look up, log, nothing more.
        with self._mid_lock:
            job, topic = self._reply_mids.get((conn, mid), ("?", "?"))
        if code == 16:  # "no matching subscribers": the caller is not listening (yet)
            log.debug("reply for job %s to %s: no subscriber", job, topic)
            return
        self.metrics.inc("reply_refused")
        log.warning("reply for job %s to %s refused by the broker: %s", job, topic, reason)


def default_device_id() -> str:
    import re
    import socket

    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].strip(".-_")
    return name or f"device-{os.getpid()}"
