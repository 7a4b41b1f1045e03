"""One model served to every front: the MQTT agent and the HTTP server share this
service's arenas, scheduler, limits and metrics.

A front submits ``Job``s whose ``front`` is itself; the scheduler's callbacks (worker
threads) come back to that front's ``on_done`` / ``on_fail`` / ``on_partial``. So a
batched bundle combines rows of MQTT and HTTP jobs into one run, the queue limit counts
both, and shutdown drains both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..executor import DTYPES, Executor
from ..threads import set_threads
from .metrics import Metrics
from .sched import Job, Scheduler

log = logging.getLogger("edgepack.serve")


class Front(Protocol):
    def on_done(self, job: Job) -> None: ...
    def on_fail(self, job: Job, code: str, message: str) -> None: ...
    def on_partial(self, job: Job, start: int, stop: int) -> None: ...


@dataclass
class ServiceConfig:
    workers: int = 1
    max_queue: int = 256  # accepted, unfinished jobs of every front together
    max_wait_ms: float = 2.0
    batching: bool = True
    max_job_bytes: int = 16 << 20
    drain_timeout: float = 30.0
    threads: int | None = None  # kernel threads per worker (numba's setting is per thread)
    inline_max_ms: float = 1.0  # run on the submitting thread when runs take less


class Service:
    def __init__(self, session, model: str, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.session = session
        self.model = model
        executors = [session.executor] + [
            # The session's device: one GPU probe, one weight upload for all workers.
            Executor(session.manifest, session.bundle.weights, device=session.executor.device)
            for _ in range(cfg.workers - 1)
        ]
        self.metrics = Metrics()
        run_s = self._warm_up(executors)
        self.sched = Scheduler(
            executors,
            batching=cfg.batching,
            max_jobs=cfg.max_queue,
            max_wait_s=cfg.max_wait_ms / 1e3,
            on_done=lambda job: job.front.on_done(job),
            on_fail=lambda job, code, message: job.front.on_fail(job, code, message),
            on_partial=lambda job, start, stop: job.front.on_partial(job, start, stop),
            thread_init=lambda: set_threads(cfg.threads),
            inline_max_s=cfg.inline_max_ms / 1e3,
            run_estimate_s=run_s,
        )
        self.input_dtypes = {t["name"]: DTYPES[t["dtype"]] for t in session.inputs}
        self.encoder = None  # a text encoder's tokenizer and pooling (/v1/embeddings)
        if "text_encoder" in session.manifest:
            from ..embed import TextEncoder

            self.encoder = TextEncoder(session.manifest, session.bundle.weights)
        self.closed = False

    def _warm_up(self, executors: list[Executor]) -> float:
        """One run per arena before going online (the first job must not pay for
        loading or compiling kernels); returns the time of a warm run in seconds."""
        set_threads(self.cfg.threads)
        feeds = {t["name"]: np.zeros(t["shape"], DTYPES[t["dtype"]]) for t in self.session.inputs}
        for ex in executors:
            ex.run_views(feeds)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            executors[0].run_views(feeds)
            best = min(best, time.perf_counter() - t)
        return best

    @property
    def inputs(self) -> list[dict]:
        return self.session.inputs

    @property
    def outputs(self) -> list[dict]:
        return self.session.outputs

    def close(self) -> None:
        """Stop taking jobs, finish the queued ones (``drain_timeout``), and fail the
        rest with ``shutting_down`` through their fronts. Idempotent."""
        if self.closed:
            return
        self.closed = True
        log.info("draining %d job(s)", self.sched.depth)
        for job in self.sched.close(self.cfg.drain_timeout):
            job.front.on_fail(job, "shutting_down", "the service stopped before this job ran")


class LLMService:
    """A language-model bundle served to every front: one generation engine
    (continuous batching over the bundle's KV-cache slots, runtime/serve/generation.py)
    that the HTTP (OpenAI) and MQTT fronts submit sequences to."""

    def __init__(self, bundle, model: str, cfg: ServiceConfig, slots: int | None = None,
                 max_tokens: int | None = None, batch_invariant: bool = False,
                 prompt_cache: bool = True) -> None:  # fmt: skip
        from ..llm import LLMSession
        from ..text import TextCodec
        from .generation import Engine

        self.cfg, self.model, self.max_tokens = cfg, model, max_tokens
        self.llm = LLMSession(bundle, threads=cfg.threads)
        self.codec = TextCodec(self.llm.bundle.manifest, self.llm.bundle.weights)
        self.metrics = Metrics()
        self._warm_up()
        self.engine = Engine(self.llm, self.codec, self.metrics, slots=slots,
                             max_waiting=cfg.max_queue, threads=cfg.threads,
                             batch_invariant=batch_invariant,
                             prompt_cache=prompt_cache)  # fmt: skip
        self.closed = False

    def _warm_up(self) -> None:
        """A prefill chunk and a decode step of every slot before going online (the
        first request must not pay for loading or compiling kernels)."""
        s = self.llm
        s.prefill([0], 0)
        for rows in s._sizes:  # every decode graph (numba compiles per shape)
            s.step_many(list(range(rows)), [0] * rows)
        for slot in range(s.slots):
            s.reset(slot)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        log.info("draining %d sequence(s)", self.engine.depth)
        self.engine.close(self.cfg.drain_timeout)
