"""Generate text with an LLM bundle: prompt -> prefill -> sample -> step, streaming.

``generate`` is a generator of text pieces; when it ends, ``stats`` (the object passed
in, or the one it returns through ``Stats``) holds the token counts and timings the CLI
prints as prompt and decode tokens per second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .llm import LLMSession
from .sampling import Sampler
from .text import Detokenizer, TextCodec


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    stop: str = ""  # "eos", "stop string", "length" or "context"

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def generate(
    session: LLMSession,
    codec: TextCodec,
    prompt: str | Sequence[int],
    max_tokens: int = 128,
    sampler: Sampler | None = None,
    stop: Sequence[str] = (),
    slot: int = 0,
    stats: Stats | None = None,
) -> Iterator[str]:
    """Text pieces of the continuation of ``prompt`` (text, or token ids as they are) in
    sequence ``slot`` (started over), until an end-of-sequence token, a ``stop``
    string (not emitted), ``max_tokens`` or the context's end."""
    sampler = sampler or Sampler()
    st = stats if stats is not None else Stats()
    ids = codec.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    session.reset(slot)
    t0 = time.perf_counter()
    logits = session.prefill(ids, slot)
    st.prompt_tokens, st.prompt_s = len(ids), time.perf_counter() - t0
    seen, text = list(ids), TextStream(codec, stop)
    t1 = time.perf_counter()
    st.stop = "length"
    while st.decode_tokens < max_tokens:
        tok = sampler(logits, seen)
        st.decode_tokens += 1
        piece = text.push(tok)
        if piece:
            yield piece
        if text.reason:
            st.stop = text.reason
            break
        seen.append(tok)
        if session.positions[slot] >= session.ctx:
            st.stop = "context"
            break
        logits = session.step(tok, slot)
    tail = text.flush()
    if tail:
        yield tail
    st.decode_s = time.perf_counter() - t1


class TextStream:
    """The text of a continuation as its tokens arrive: the pieces safe to show (a tail
    that could still become a stop string is held back), and why it ended (``reason``:
    "eos" or "stop string"; None while it goes on). Serves ``generate`` and the
    server's sequences alike."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec, self.stop = codec, [s for s in stop if s]
        self.detok = Detokenizer(codec)
        self.text, self.held, self.reason = "", 0, None
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    def push(self, token: int) -> str:
        """The piece to emit after ``token`` ("" while it is held back or ends the
        text: an end-of-sequence token, or the text reaching a stop string, which is
        not emitted)."""
        if token in self.codec.eos_ids:
            self.reason = "eos"
            return ""
        self.text += self.detok.push(token)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.reason = "stop string"
            piece = self.text[self.held : cut] if cut > self.held else ""
            self.held = len(self.text)
            return piece
        safe = len(self.text) - self._hold
        if safe <= self.held:
            return ""
        piece, self.held = self.text[self.held : safe], safe
        return piece

    def flush(self) -> str:
        """The held-back tail, when the text ends for another reason than a stop string
        (it never became one)."""
        if self.reason == "stop string":
            return ""
        piece, self.held = self.text[self.held :], len(self.text)
        return piece
