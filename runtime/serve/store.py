"""Answers by job id: the agent's half of "no job is lost and none is answered twice".

A client that hears nothing re-sends the job with the same id. If this agent already
answered, the stored replies go out again (marked ``dup``) instead of a second run; if
the job is still queued or running, the new reply address joins it and gets the same
answer. Stored answers are kept for ``ttl_s`` seconds, bounded by count and bytes
(oldest evicted first); transient errors (busy, deadline...) are not stored, so a
retry runs again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .protocol import Reply, ReplyAddress


@dataclass
class _Entry:
    addrs: list[ReplyAddress]
    replies: list[Reply] = field(default_factory=list)
    done: bool = False
    done_at: float = 0.0
    nbytes: int = 0


def _same(a: ReplyAddress, b: ReplyAddress) -> bool:
    key = lambda x: (x.topic, x.correlation, x.json_correlation)  # noqa: E731
    return key(a) == key(b)


class ReplyStore:
    def __init__(
        self, max_entries: int = 10_000, max_bytes: int = 64 << 20, ttl_s: float = 600.0
    ) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._pending: dict[str, _Entry] = {}
        self._done: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def claim(self, job_id: str, addr: ReplyAddress) -> tuple[str, list[Reply]]:
        """("new", []): run it. ("pending", replies so far): already running, ``addr``
        will get the rest. ("done", replies): answered before; send these again."""
        with self._lock:
            e = self._done.get(job_id)
            if e is not None:
                if time.monotonic() - e.done_at <= self.ttl_s:
                    return "done", list(e.replies)
                self._drop_done(job_id)
            e = self._pending.get(job_id)
            if e is not None:
                if not any(_same(a, addr) for a in e.addrs):
                    e.addrs.append(addr)
                return "pending", list(e.replies)
            self._pending[job_id] = _Entry([addr])
            return "new", []

    def claim_known(self, job_id: str, addr: ReplyAddress) -> tuple[str, list[Reply]] | None:
        """``claim`` for a job this agent already has, else None (and nothing recorded):
        lets a re-sent job be answered before its payload is even decoded."""
        with self._lock:
            if job_id not in self._done and job_id not in self._pending:
                return None
        state, replies = self.claim(job_id, addr)
        return (state, replies) if state != "new" else None

    def add(self, job_id: str, reply: Reply) -> list[ReplyAddress]:
        """Record a stream part; returns the addresses to send it to."""
        with self._lock:
            e = self._pending.get(job_id)
            if e is None:
                return []
            e.replies.append(reply)
            e.nbytes += reply.nbytes
            return list(e.addrs)

    def finish(self, job_id: str, reply: Reply, keep: bool = True) -> list[ReplyAddress]:
        """Record the final reply; returns the addresses to send it to. ``keep=False``
        (transient errors) forgets the job so that a retry runs it again."""
        with self._lock:
            e = self._pending.pop(job_id, None)
            if e is None:
                return []
            if not keep:
                return list(e.addrs)
            e.replies.append(reply)
            e.nbytes += reply.nbytes
            e.done, e.done_at = True, time.monotonic()
            self._done[job_id] = e
            self._bytes += e.nbytes
            self._evict()
            return list(e.addrs)

    def expire(self) -> None:
        with self._lock:
            self._evict()

    def __len__(self) -> int:
        return len(self._done)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop_done(self, job_id: str) -> None:
        e = self._done.pop(job_id)
        self._bytes -= e.nbytes

    def _evict(self) -> None:
        now = time.monotonic()
        while self._done:
            job_id, e = next(iter(self._done.items()))
            if (
                len(self._done) > self.max_entries
                or self._bytes > self.max_bytes
                or now - e.done_at > self.ttl_s
            ):
                self._drop_done(job_id)
            else:
                break
