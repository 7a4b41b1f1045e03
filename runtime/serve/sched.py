"""The agent's scheduler: a bounded job queue, dynamic batching and a pool of arenas.

Each worker thread owns one ``Executor`` (one arena) over the same memory-mapped
weights, so N workers cost N arenas and nothing else. A bundle "has a batch dimension"
when every input and output shares the same leading dimension B (``batch_rows``): a
job may then carry any number of rows, is cut into items of at most B rows, and a
worker packs items of several jobs into one run (up to B rows, waiting at most
``max_wait_s`` for more), zero-filling unused rows. Bundles without one run each job
as is. Jobs whose deadline has passed are failed instead of run, and the caller turns
late answers into errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..executor import DTYPES, Executor  # the arena's dtypes (token ids are i64)

log = logging.getLogger("edgepack.agent")


class BadInput(ValueError):
    """Inputs that do not fit the model (names, dtypes, shapes)."""


def batch_rows(inputs: list[dict], outputs: list[dict]) -> int | None:
    """B when every input and output has the same leading dimension B, else None."""
    dims = {t["shape"][0] if t["shape"] else None for t in inputs + outputs}
    if len(dims) != 1 or None in dims:
        return None
    return int(dims.pop())


def spec_str(t: dict, rows: str | None = None) -> str:
    dims = [rows] + [str(d) for d in t["shape"][1:]] if rows else map(str, t["shape"])
    return f"{t['name']} {t['dtype']}[{'x'.join(dims)}]"


@dataclass(eq=False)  # identity semantics: jobs live in sets
class Job:
    """One accepted job. ``ctx`` is the caller's (reply address, encoding, ...)."""

    id: str
    feeds: list[np.ndarray]  # in model input order
    rows: int
    deadline: float | None
    stream: bool
    received: float
    ctx: object = None
    front: object = None  # the front that answers it (service.Front), for its callbacks
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    items_left: int = 0
    failed: bool = False
    seq: int = 0  # next stream sequence number
    started: float | None = None
    run_s: float = 0.0
    batch: int = 0  # largest number of real rows in a run this job was part of
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Item:
    job: Job
    start: int
    stop: int
    done: bool = False


class Scheduler:
    """Callbacks run on worker threads: ``on_partial(job, start, stop)`` after each item
    of a stream job, ``on_done(job)`` once all its rows are in ``job.outputs``,
    ``on_fail(job, code, message)`` at most once per job instead of ``on_done``."""

    def __init__(
        self,
        executors: list[Executor],
        *,
        batching: bool = True,  # combine jobs into one run
        max_jobs: int = 256,
        max_wait_s: float = 0.002,
        on_done: Callable[[Job], None],
        on_fail: Callable[[Job, str, str], None],
        on_partial: Callable[[Job, int, int], None] | None = None,
        thread_init: Callable[[], None] | None = None,
        inline_max_s: float = 0.001,
        run_estimate_s: float = 0.001,
    ) -> None:
        ex = executors[0]
        self.inputs, self.outputs = ex.inputs, ex.outputs
        self.batch = batch_rows(self.inputs, self.outputs)
        self.combine = batching  # False: a run never mixes rows of different jobs
        self.max_jobs = max_jobs
        self.max_wait_s = max_wait_s
        self.on_done, self.on_fail, self.on_partial = on_done, on_fail, on_partial
        self.thread_init = thread_init
        self._q: deque[_Item] = deque()
        self._cv = threading.Condition()
        self._jobs: set[Job] = set()  # accepted, not finished
        self._closed = False
        self._stopping = False
        self.batches = 0
        self.rows_run = 0
        self._batch_s = run_estimate_s  # moving average of one run (retry hints, inlining)
        self.inline_max_s = inline_max_s
        # The pool of arenas: a run borrows one executor (with its batch buffers).
        self._free: list[tuple[Executor, list | None]] = [(e, self._buffers()) for e in executors]
        self._tls = threading.local()
        self._names = [t["name"] for t in self.inputs]
        self._workers = [
            threading.Thread(target=self._work, name=f"edgepack-worker-{i}", daemon=True)
            for i in range(len(executors))
        ]
        for t in self._workers:
            t.start()

    # --- admission --------------------------------------------------------------------

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], int]:
        """The feeds in input order and the job's row count, or BadInput."""
        names = [t["name"] for t in self.inputs]
        if set(feeds) != set(names):
            unknown = sorted(set(feeds) - set(names))
            missing = [n for n in names if n not in feeds]
            parts = ([f"unknown: {', '.join(unknown)[:200]}"] if unknown else []) + (
                [f"missing: {', '.join(missing)}"] if missing else []
            )
            raise BadInput(f"inputs {'; '.join(parts)}; expected: {self.expected()}")
        arrays, rows = [], None
        for t in self.inputs:
            a = feeds[t["name"]]
            want = DTYPES[t["dtype"]]
            if a.dtype != want:
                raise BadInput(
                    f"input {t['name']!r} has dtype {a.dtype}, expected {want}; "
                    f"expected: {self.expected()}"
                )
            shape = list(t["shape"])
            if self.batch is None:
                ok = list(a.shape) == shape
            else:
                ok = a.ndim == len(shape) and list(a.shape[1:]) == shape[1:] and a.shape[0] >= 1
            if not ok:
                raise BadInput(
                    f"input {t['name']!r} has shape {list(a.shape)}, expected "
                    f"{self._shape_str(t)}; expected: {self.expected()}"
                )
            n = a.shape[0] if self.batch is not None else 1
            if rows is not None and n != rows:
                raise BadInput(f"inputs have different row counts ({rows} and {n})")
            rows = n
            arrays.append(np.ascontiguousarray(a))
        return arrays, int(rows or 1)

    def _shape_str(self, t: dict) -> str:
        if self.batch is None:
            return str(list(t["shape"]))
        return f"[N, {', '.join(map(str, t['shape'][1:]))}] with N >= 1 rows".replace(
            "[N, ]", "[N]"
        )

    def expected(self) -> str:
        rows = "N" if self.batch is not None else None
        return ", ".join(spec_str(t, rows) for t in self.inputs)

    def submit(self, job: Job) -> str | None:
        """Queue ``job``; returns None, or "busy" / "shutting_down" when refused."""
        if self.batch is not None:
            step = self.batch
            items = [_Item(job, s, min(s + step, job.rows)) for s in range(0, job.rows, step)]
            job.outputs = {
                t["name"]: np.empty((job.rows, *t["shape"][1:]), DTYPES[t["dtype"]])
                for t in self.outputs
            }
        else:
            items = [_Item(job, 0, 1)]
        job.items_left = len(items)
        arena = None
        with self._cv:
            if self._closed:
                return "shutting_down"
            if len(self._jobs) >= self.max_jobs:
                return "busy"
            self._jobs.add(job)
            if (
                len(items) == 1
                and not self._q
                and self._free
                and self._batch_s < self.inline_max_s
                and (self.batch in (None, 1) or not self.combine)
            ):
                # Nothing to wait for and nothing to batch with: run it on this (the
                # network) thread. Two thread wake-ups fewer per job, which is most of
                # the agent's latency on a busy CPU; only for runs shorter than
                # inline_max_s, so the network thread is never held up for long.
                arena = self._free.pop()
            else:
                self._q.extend(items)
                self._cv.notify(len(items))
        if arena is not None:
            self._run_on(arena, items)
        return None

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def retry_after_ms(self) -> int:
        """A hint for busy replies: time to work through the current queue."""
        per_run = self.batch or 1
        runs = len(self._q) / per_run + 1
        return int(min(60_000, max(10, 1e3 * runs * self._batch_s / len(self._workers))))

    # --- shutdown ---------------------------------------------------------------------

    def close(self, drain_timeout: float) -> list[Job]:
        """Stop taking jobs, finish the queued ones within ``drain_timeout`` seconds,
        then stop the workers. Returns the jobs still unfinished, already marked failed
        (the caller answers them)."""
        end = time.monotonic() + drain_timeout
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: not self._jobs, timeout=max(0.0, drain_timeout))
            self._stopping = True
            self._q.clear()
            self._cv.notify_all()
        for t in self._workers:
            t.join(timeout=max(0.1, end - time.monotonic()))
        with self._cv:
            left = list(self._jobs)
            self._jobs.clear()
        out = []
        for job in left:
            with job.lock:
                if not job.failed:
                    job.failed = True
                    out.append(job)
        return out

    # --- workers ----------------------------------------------------------------------

    def _take(self) -> tuple[tuple, list[_Item]] | None:
        """Wait for work and a free arena; returns (arena, items) or None to stop."""
        with self._cv:
            while not (self._q and self._free) and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            arena = self._free.pop()
            first = self._q.popleft()
            items, rows = [first], first.stop - first.start
            if self.batch is None or self.batch == 1 or not self.combine:
                return arena, items
            until = time.monotonic() + self.max_wait_s
            while rows < self.batch and not self._stopping:
                if self._q:
                    n = self._q[0].stop - self._q[0].start
                    if rows + n > self.batch:
                        break
                    items.append(self._q.popleft())
                    rows += n
                    continue
                left = until - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cv.wait(left)
            return arena, items

    def _buffers(self) -> list | None:
        if self.batch is None:
            return None
        return [np.zeros(t["shape"], DTYPES[t["dtype"]]) for t in self.inputs]

    def _work(self) -> None:
        while True:
            got = self._take()
            if got is None:
                return
            self._run_on(*got)

    def _run_on(self, arena: tuple, items: list[_Item]) -> None:
        """Run ``items`` on a borrowed arena, give it back, never raise."""
        if not getattr(self._tls, "ready", False):
            if self.thread_init is not None:
                self.thread_init()  # e.g. numba's thread count, which is per thread
            self._tls.ready = True
        ex, bufs = arena
        try:
            self._run(ex, items, bufs, self._names)
        except Exception as e:  # a kernel bug must not take the agent down
            log.exception("run failed for jobs %s", [it.job.id for it in items])
            for it in items:
                if not it.done:
                    self.fail(it.job, "internal", f"run failed: {type(e).__name__}: {e}")
                    self._item_finished(it)
        finally:
            with self._cv:
                self._free.append(arena)
                self._cv.notify()

    def _run(self, ex: Executor, items: list[_Item], bufs, names: list[str]) -> None:
        now = time.monotonic()
        live = []
        for it in items:
            job = it.job
            if job.failed:
                self._item_finished(it)
            elif job.deadline is not None and now > job.deadline:
                waited = (now - job.received) * 1e3
                self.fail(job, "deadline_exceeded", f"deadline passed after {waited:.0f} ms queued")
                self._item_finished(it)
            else:
                if job.started is None:
                    job.started = now
                live.append(it)
        if not live:
            return
        t0 = time.perf_counter()
        if bufs is None:
            job = live[0].job
            outs = ex.run_views(dict(zip(names, job.feeds)))
            job.outputs = {t["name"]: o.copy() for t, o in zip(self.outputs, outs)}
            rows = 1
        else:
            rows = 0
            for it in live:
                n = it.stop - it.start
                for buf, a in zip(bufs, it.job.feeds):
                    buf[rows : rows + n] = a[it.start : it.stop]
                rows += n
            if rows < self.batch:
                for buf in bufs:
                    buf[rows:] = 0
            outs = ex.run_views(dict(zip(names, bufs)))
            r = 0
            for it in live:
                n = it.stop - it.start
                for t, o in zip(self.outputs, outs):
                    it.job.outputs[t["name"]][it.start : it.stop] = o[r : r + n]
                r += n
        dt = time.perf_counter() - t0
        self._batch_s = 0.9 * self._batch_s + 0.1 * dt
        self.batches += 1
        self.rows_run += rows
        for it in live:
            it.job.run_s += dt
            it.job.batch = max(it.job.batch, rows)
            if it.job.stream and self.on_partial is not None and not it.job.failed:
                _call(self.on_partial, it.job, it.start, it.stop)
            self._item_finished(it)

    def fail(self, job: Job, code: str, message: str) -> None:
        """Fail ``job`` once (its other items are skipped); reports via on_fail."""
        with job.lock:
            if job.failed:
                return
            job.failed = True
        _call(self.on_fail, job, code, message)

    def _item_finished(self, it: _Item) -> None:
        job = it.job
        with job.lock:
            if it.done:
                return
            it.done = True
            job.items_left -= 1
            last = job.items_left == 0
            ok = last and not job.failed
        if not last:
            return
        if ok:
            _call(self.on_done, job)
        with self._cv:
            self._jobs.discard(job)
            if not self._jobs:
                self._cv.notify_all()


def _call(fn: Callable, *args) -> None:
    """Run a caller's callback; its failure (e.g. a publish error) is logged and must
    neither kill a worker nor fail the job a second time."""
    try:
        fn(*args)
    except Exception:
        log.exception("callback %s failed", getattr(fn, "__name__", fn))
