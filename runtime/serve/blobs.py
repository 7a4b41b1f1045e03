"""Inputs sent by reference: reassemble retained chunks from the broker.

An input larger than the broker's message limit is published by the client as
retained chunks ``<ref.topic>/0 .. /<parts-1>`` (with a message expiry), and the job
carries ``ref`` instead of ``inputs``. The agent that takes the job subscribes to
``<ref.topic>/+``, the broker hands it the retained chunks, and once all are in and the
SHA-256 matches, the job continues as if the bytes had arrived inline. This works for
per-device and shared-subscription jobs alike, since only the agent that took the job
fetches the chunks.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .protocol import BlobRef

log = logging.getLogger("edgepack.agent")


@dataclass
class _Fetch:
    ref: BlobRef
    on_done: Callable[[bytes], None]
    on_error: Callable[[str, str], None]
    expires: float
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class BlobFetcher:
    def __init__(
        self,
        subscribe: Callable[[str], None],
        unsubscribe: Callable[[str], None],
        max_pending: int = 8,
        timeout_s: float = 30.0,
    ) -> None:
        self._sub, self._unsub = subscribe, unsubscribe
        self.max_pending, self.timeout_s = max_pending, timeout_s
        self._fetches: dict[str, _Fetch] = {}  # by ref.topic
        self._lock = threading.Lock()

    def topics(self) -> list[str]:
        """Subscriptions to remake after a reconnect that lost the session."""
        with self._lock:
            return [f"{t}/+" for t in self._fetches]

    def start(
        self,
        ref: BlobRef,
        on_done: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        deadline: float | None,
    ) -> str | None:
        """Begin fetching; returns None or an error code ("busy") when refused."""
        expires = time.monotonic() + self.timeout_s
        if deadline is not None:
            expires = min(expires, deadline)
        with self._lock:
            if ref.topic in self._fetches or len(self._fetches) >= self.max_pending:
                return "busy"
            self._fetches[ref.topic] = _Fetch(ref, on_done, on_error, expires)
        self._sub(f"{ref.topic}/+")
        return None

    def on_chunk(self, topic: str, payload: bytes) -> None:
        base, _, idx = topic.rpartition("/")
        with self._lock:
            f = self._fetches.get(base)
            if f is None or not payload:  # not ours, or a cleared retained chunk
                return
            try:
                i = int(idx)
            except ValueError:
                return
            if not 0 <= i < f.ref.parts or i in f.parts:
                return
            f.parts[i] = bytes(payload)
            f.size += len(payload)
            complete = len(f.parts) == f.ref.parts
            too_big = f.size > f.ref.nbytes
            if complete or too_big:
                del self._fetches[base]
        if not (complete or too_big):
            return
        self._unsub(f"{base}/+")
        data = b"".join(f.parts[k] for k in range(f.ref.parts)) if complete else b""
        if too_big or len(data) != f.ref.nbytes:
            msg = f"chunks under {base} do not add up to {f.ref.nbytes} B"
            f.on_error("input_unavailable", msg)
        elif hashlib.sha256(data).hexdigest() != f.ref.sha256:
            f.on_error("input_unavailable", f"chunks under {base} do not match ref.sha256")
        else:
            f.on_done(data)

    def expire(self, now: float | None = None, code: str = "input_unavailable") -> None:
        """Fail fetches past their time (``now=inf`` fails all, at shutdown)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [(t, f) for t, f in self._fetches.items() if now >= f.expires]
            for t, _ in gone:
                del self._fetches[t]
        for t, f in gone:
            self._unsub(f"{t}/+")
            f.on_error(
                code,
                f"only {len(f.parts)} of {f.ref.parts} chunks of {t} arrived"
                if code == "input_unavailable"
                else "the agent is shutting down",
            )
