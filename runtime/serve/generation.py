"""Continuous batching of text generation: one engine thread runs every sequence of an
LLM bundle's slots, for the HTTP (OpenAI) and MQTT fronts alike.

Each turn of the loop:

1. admits waiting sequences into free KV-cache slots (a slot is the bundle's planned
   cache rows: no allocation per request), each into the free slot whose cache starts
   with the longest run of its prompt's tokens: those positions are kept, not computed
   again (the prompt cache: a shared system prompt, or a chat's earlier turns);
2. when the prompts being read do not fit in the rows the decode step leaves free,
   runs **one prefill chunk** (the bundle's ``chunk`` tokens) holding them, oldest
   first, each but its last token (``prefill_many``: rows name their sequence, so
   several prompts share one run); a long prompt never stalls the running streams for
   more than one chunk a turn;
3. runs **one decode step for every generating sequence together**, its free rows
   filled with prompt tokens (``LLMSession.step_rows``; a prompt that ends there gets
   its first token from its last row): the decode graph has a row per slot, so its
   projections are one GEMM over the rows, not a GEMV per sequence, and a short prompt
   costs a few rows of a step instead of a chunk of mostly idle rows;
4. samples each sequence's next token with its own sampler, streams its text, and
   frees the slot of a sequence that ended (end of sequence, a stop string,
   ``max_tokens``, the context's end, a cancel, its deadline).

Each step runs the smallest decode graph holding its sequences (the bundle carries
graphs of 1, 2, 4... rows), so one stream on a 16-slot bundle pays for one row. Graphs
of different row counts round differently in the last bits; with ``batch_invariant``
every step runs the graph of ``slots`` rows instead, and a sequence's tokens do not
depend on what runs beside it (checked: 16 concurrent streams give the tokens of 16
sequential ones, tests/test_openai_api.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..generate import TextStream
from ..llm import LLMSession
from ..sampling import Sampler
from ..text import TextCodec
from ..threads import set_threads
from .metrics import Metrics

log = logging.getLogger("edgepack.generation")

# finish reasons, OpenAI's words: "stop" (end of sequence or a stop string), "length"
# (max_tokens or the context), and edgepack's own for ends the caller did not ask for
FINISH = {"eos": "stop", "stop string": "stop", "length": "length", "context": "length"}


@dataclass(eq=False)
class GenSequence:
    """One generation request. ``emit(kind, data)`` is called on the engine thread:
    ``("text", {"text": piece, "tokens": n})`` as text becomes safe to show (``n``: the
    tokens generated so far), then exactly once
    ``("done", {...})`` or ``("error", {"code", "message"})``."""

    id: str
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    emit: Callable[[str, dict], None]
    stop: Sequence[str] = ()
    deadline: float | None = None  # time.monotonic()
    received: float = field(default_factory=time.monotonic)
    front: str = "http"
    # called once a turn, after that turn's events of every sequence sharing it (the
    # front's one wake-up for them all: see Engine._deliver)
    flush: Callable[[], None] | None = None
    # engine state
    slot: int = -1
    cached: int = 0  # prompt tokens not computed: the slot held them, or were shared
    fed: int = 0  # prompt tokens prefilled (cached ones included)
    share_from: GenSequence | None = None  # a running sequence to copy the start of
    share_n: int = 0  # ... this many positions, once it has computed them
    last: int = -1  # the token to feed next
    completion_tokens: int = 0
    first_token_at: float | None = None
    started_at: float | None = None
    cancelled: str | None = None  # why: "cancelled", "shutting_down"
    finished: bool = False
    text: TextStream | None = None
    seen: list[int] = field(default_factory=list)


class EngineBusy(Exception):
    def __init__(self, code: str, retry_after_s: float) -> None:
        super().__init__(code)
        self.code, self.retry_after_s = code, retry_after_s


class Engine:
    def __init__(self, session: LLMSession, codec: TextCodec, metrics: Metrics,
                 slots: int | None = None, max_waiting: int = 64,
                 threads: int | None = None, batch_invariant: bool = False,
                 prompt_cache: bool = True) -> None:  # fmt: skip
        self.session, self.codec, self.metrics = session, codec, metrics
        self.slots = min(slots or session.slots, session.slots)
        self.prompt_cache, self.batch_invariant = prompt_cache, batch_invariant
        # Every decode step on the graph of `slots` rows, whatever runs: a sequence's
        # tokens then do not depend on the others (graphs of other row counts round
        # differently in the last bits), at the cost of computing idle rows.
        self.min_rows = self.slots if batch_invariant else 0
        self.max_waiting = max_waiting
        self.threads = threads
        self._free = list(range(self.slots))[::-1]
        # The tokens whose keys and values each free slot's cache holds, from position 0
        # (what its last sequence fed); a new prompt keeps the run it shares with them.
        self._held: list[list[int]] = [[] for _ in range(self.slots)]
        self._waiting: deque[GenSequence] = deque()
        self._running: list[GenSequence] = []
        self._cv = threading.Condition()
        self._closed = self._stopping = False
        self.steps = self.rows = 0  # decode steps, and the sequences they advanced
        self._step_s = 0.02  # moving average of a loop turn (retry hints)
        # A turn's events, handed to the fronts after its sampling: emitting wakes a
        # front's thread, which then takes the GIL from this one; once a turn, not once
        # a sequence (8 streams: sampling and emitting 1.3 -> 0.2 ms a turn).
        self._outbox: list[tuple[GenSequence, str, dict]] = []
        self._thread = threading.Thread(target=self._loop, name="edgepack-generate", daemon=True)
        self._thread.start()

    @property
    def ctx(self) -> int:
        return self.session.ctx

    @property
    def active(self) -> int:
        """KV slots in use."""
        return self.slots - len(self._free)

    @property
    def depth(self) -> int:
        return len(self._waiting) + len(self._running)

    def submit(self, seq: GenSequence) -> None:
        """Queue ``seq``; EngineBusy("busy" | "shutting_down") when refused. The caller
        has checked that the prompt fits the context."""
        seq.text = TextStream(self.codec, seq.stop)
        seq.seen = list(seq.prompt)
        with self._cv:
            if self._closed:
                raise EngineBusy("shutting_down", 1.0)
            if len(self._waiting) >= self.max_waiting:
                turns = (len(self._waiting) / self.slots + 1) * max(1, seq.max_tokens)
                raise EngineBusy("busy", min(60.0, turns * self._step_s))
            self._waiting.append(seq)
            self._cv.notify()

    def cancel(self, seq: GenSequence, why: str = "cancelled") -> None:
        """End ``seq`` at the engine's next turn (its slot is freed then); nothing more
        is emitted for it but its final ``error`` with code ``why``."""
        with self._cv:
            if not seq.finished and seq.cancelled is None:
                seq.cancelled = why
                self._cv.notify()

    def close(self, drain_timeout: float) -> None:
        """Stop taking requests, let the running and waiting ones finish for at most
        ``drain_timeout`` seconds, end the rest with ``shutting_down``, stop."""
        end = time.monotonic() + drain_timeout
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: not self._waiting and not self._running,
                              timeout=max(0.0, drain_timeout))  # fmt: skip
            for seq in list(self._waiting) + self._running:
                if seq.cancelled is None:
                    seq.cancelled = "shutting_down"
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._waiting and not self._running, timeout=10.0)
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=max(0.1, end - time.monotonic()) + 10.0)

    # --- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        set_threads(self.threads)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._running
                                  or (self._waiting and self._free))  # fmt: skip
                if self._stopping:
                    return
                while self._waiting and self._free:
                    seq = self._waiting.popleft()
                    self._take_slot(seq)
                    self._running.append(seq)
            t0 = time.perf_counter()
            try:
                self._turn()
            except Exception as e:  # a kernel bug must not take the server down
                log.exception("generation step failed")
                for seq in list(self._running):
                    self._finish(seq, error=("internal", f"{type(e).__name__}: {e}"))
            self._deliver()
            self._step_s = 0.9 * self._step_s + 0.1 * (time.perf_counter() - t0)

    def _take_slot(self, seq: GenSequence) -> None:
        """Give ``seq`` a free slot, and the longest start of its prompt that a cache
        holds or will hold (the last prompt token is always fed again: its logits give
        the first token):

        - a free slot whose cache starts with it: that slot, nothing copied, when the
          cache holds nothing more or no slot is empty; else an empty slot, with those
          positions copied into it, and the slot keeps the rest of its cache for its
          own follow-up (two chats, or two prompts, with one system prompt taking
          turns: each finds its whole prompt again; taking the slot cut the other's
          off at the shared start);
        - a running sequence whose tokens (fed, or still to feed) start with it, if
          longer: ``seq`` copies those positions from that sequence's slot once they
          are computed (``_share``; requests arriving together with one system prompt
          compute it once);
        - else an empty slot if any is free, else the least recently freed (``_free``
          is a stack, newest last), so recent caches stay for their follow-ups."""
        own, oi, src, best = 0, -1, None, 0
        if self.prompt_cache:
            limit = len(seq.prompt) - 1
            for i, slot in enumerate(self._free):
                n = _common(self._held[slot], seq.prompt, limit)
                if n > own:
                    own, oi = n, i
            best = own
            for q in self._running:
                n = _common(self._shareable(q), seq.prompt, limit)
                if n > best and not q.finished and q.cancelled is None:
                    src, best = q, n
        if src is not None or oi < 0:
            own, oi = 0, self._spare()
        elif own < len(self._held[self._free[oi]]):
            empty = self._spare()
            if not self._held[self._free[empty]]:
                self.session.share(self._free[oi], self._free[empty], own)
                oi = empty
        seq.slot, seq.cached = self._free.pop(oi), own
        self._held[seq.slot] = []
        if src is not None:
            seq.share_from, seq.share_n = src, best

    def _spare(self) -> int:
        """The index in ``_free`` of the slot to fill when no cache is kept: an empty
        one if any, else the least recently freed."""
        return next((i for i in range(len(self._free) - 1, -1, -1)
                     if not self._held[self._free[i]]), 0)  # fmt: skip

    def _shareable(self, q: GenSequence) -> Sequence[int]:
        """The tokens whose keys and values running sequence ``q``'s slot holds or will
        hold, from position 0 (as ``_fed_tokens`` keeps them for a free slot)."""
        return q.prompt[: len(q.prompt) - 1] if self.batch_invariant else q.seen

    def _share(self, seq: GenSequence) -> None:
        """Copy the positions ``seq`` shares with its source once the source has computed
        them; if the source ended first, ``seq`` computes its prompt itself."""
        src = seq.share_from
        if src.finished or src.cancelled is not None or src.started_at is None:
            seq.share_from = None
        elif self.session.positions[src.slot] >= seq.share_n:
            self.session.share(src.slot, seq.slot, seq.share_n)
            seq.fed = seq.cached = seq.share_n
            seq.share_from = None

    def _turn(self) -> None:
        now = time.monotonic()
        for seq in list(self._running):
            if seq.cancelled is not None:
                self._finish(seq, error=(seq.cancelled, _CANCEL_TEXT[seq.cancelled]))
            elif seq.deadline is not None and now > seq.deadline:
                self._finish(seq, error=("deadline_exceeded", "the deadline passed"))
        s = self.session
        for seq in self._running:
            if seq.started_at is None:
                s.keep(seq.slot, seq.cached)
                seq.fed = seq.cached
                seq.started_at = time.monotonic()
            if seq.share_from is not None:
                self._share(seq)
        going = [q for q in self._running if q.fed == len(q.prompt) and not q.finished
                 and q.last >= 0]  # fmt: skip
        reading = [q for q in self._running if q.fed < len(q.prompt) and q.share_from is None]
        free = s.max_rows - len(going)
        if self.min_rows or sum(len(q.prompt) - q.fed for q in reading) > free:
            # Prompts the step cannot take whole: a prompt chunk, each prompt but its
            # last token, packed oldest first (rows name their sequence, so several
            # short prompts share one run). Batch-invariant serving always takes this
            # path, so a prompt token's rounding never depends on what runs beside it.
            parts, room = [], s.chunk
            for seq in reading:
                n = min(len(seq.prompt) - 1 - seq.fed, room)
                if n > 0:
                    parts.append((seq.slot, seq.prompt[seq.fed : seq.fed + n]))
                    seq.fed += n
                    room -= n
            if parts:
                s.prefill_many(parts)
        # One decode-graph run: each generating sequence's next token, then prompt
        # tokens (oldest first) in the rows left, so a short prompt, or a long one's
        # tail, needs no prompt chunk of mostly idle rows; a prompt that ends in the
        # step has its first token from its last row's logits.
        items = [(q.slot, [q.last]) for q in going]
        owners = list(going)
        for seq in reading:
            n = min(len(seq.prompt) - seq.fed, free)
            if n <= 0 or (self.min_rows and n > 1):
                continue
            items.append((seq.slot, seq.prompt[seq.fed : seq.fed + n]))
            owners.append(seq)
            seq.fed += n
            free -= n
        if items:
            outs = s.step_rows(items, self.min_rows)
            self.steps += 1
            self.rows += len(items)
            for seq, logits in zip(owners, outs):
                if seq.fed == len(seq.prompt):
                    self._next(seq, logits)

    def _deliver(self) -> None:
        """Emit the turn's events, then call each distinct ``flush`` once: the HTTP
        front queues events without waking its loop and wakes it in the flush. Woken at
        its first event, the loop thread took the GIL while this thread was still
        emitting, once for each of 8 streams' events: 6 % of this thread's time went to
        those hand-offs (py-spy, 8 streams)."""
        out, self._outbox = self._outbox, []
        flushes: dict[Callable[[], None], None] = {}  # bound methods of one object: equal
        for seq, kind, data in out:
            try:
                seq.emit(kind, data)
            except Exception:  # a front that went away must not stop the others
                log.exception("emitting %s failed", kind)
            if seq.flush is not None:
                flushes[seq.flush] = None
        for flush in flushes:
            try:
                flush()
            except Exception:
                log.exception("flushing events failed")

    def _fed_tokens(self, seq: GenSequence, error: tuple[str, str] | None) -> list[int]:
        """The tokens ``seq`` left in its slot's cache that a later prompt may reuse:
        all it fed (prompt, then its own tokens up to the last fed); nothing after a
        failed step. Batch-invariant serving keeps only the prompt tokens that went
        through prefill chunks, where a later prompt's tokens go too: reused positions
        then hold the bits that computing them again would give."""
        if seq.started_at is None or (error is not None and error[0] == "internal"):
            return []
        n = self.session.positions[seq.slot]
        if self.batch_invariant:
            n = min(n, len(seq.prompt) - 1)
        return seq.seen[:n]

    def _next(self, seq: GenSequence, logits) -> None:
        """Sample ``seq``'s next token from ``logits`` and stream it, or end it."""
        tok = seq.sampler(logits, seq.seen)
        seq.completion_tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            self.metrics.observe("time_to_first_token_seconds", seq.front,
                                 seq.first_token_at - seq.received)  # fmt: skip
        piece = seq.text.push(tok)
        if piece:
            self._outbox.append((seq, "text", {"text": piece,
                                                    "tokens": seq.completion_tokens}))
        reason = seq.text.reason
        if reason is None:
            seq.seen.append(tok)
            seq.last = tok
            if seq.completion_tokens >= seq.max_tokens:
                reason = "length"
            elif self.session.positions[seq.slot] >= self.session.ctx:
                reason = "context"
        if reason is not None:
            self._finish(seq, reason=reason)

    def _finish(self, seq: GenSequence, reason: str | None = None,
                error: tuple[str, str] | None = None) -> None:  # fmt: skip
        seq.finished = True
        # counted before the slot is freed: a client that sees the slot free (the
        # kv_slots_in_use gauge) sees the counts of its end too
        self.metrics.inc("tokens_generated", seq.completion_tokens)
        self.metrics.inc("tokens_prompt", seq.fed)
        self.metrics.inc("tokens_prompt_cached", seq.cached)
        if error is not None:
            self.metrics.error(error[0])
        with self._cv:
            if seq in self._running:
                self._running.remove(seq)
                self._held[seq.slot] = self._fed_tokens(seq, error)
                self._free.append(seq.slot)
            if not self._running and not self._waiting:
                self._cv.notify_all()
        if error is not None:
            self._outbox.append((seq, "error", {"code": error[0], "message": error[1]}))
            return
        tail = seq.text.flush()
        if tail:
            self._outbox.append((seq, "text", {"text": tail,
                                                    "tokens": seq.completion_tokens}))
        now = time.monotonic()
        first = seq.first_token_at or now
        decode_s = now - first
        self.metrics.inc("ok")
        self.metrics.latency((now - seq.received) * 1e3, seq.front)
        self._outbox.append((seq, "done", {
            "finish_reason": FINISH[reason],
            "stop": reason,
            "usage": {"prompt_tokens": len(seq.prompt),
                      "completion_tokens": seq.completion_tokens,
                      "total_tokens": len(seq.prompt) + seq.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": seq.cached}},
            "timings": {"queue_ms": round(((seq.started_at or first) - seq.received) * 1e3, 3),
                        "ttft_ms": round((first - seq.received) * 1e3, 3),
                        "decode_tps": round((seq.completion_tokens - 1) / decode_s, 2)
                        if decode_s > 0 and seq.completion_tokens > 1 else None},
        }))  # fmt: skip


_CANCEL_TEXT = {
    "cancelled": "the request was cancelled",
    "shutting_down": "the server stopped before this request finished",
}


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of the common start of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return max(n, 0)
