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
    seen, detok, text, held = list(ids), Detokenizer(codec), "", 0
    t1 = time.perf_counter()
    st.stop = "length"
    while st.decode_tokens < max_tokens:
        tok = sampler(logits, seen)
        st.decode_tokens += 1
        if tok in codec.eos_ids:
            st.stop = "eos"
            break
        seen.append(tok)
        text += detok.push(tok)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            if cut > held:
                yield text[held:cut]
            st.stop = "stop string"
            break
        # hold back a tail that could still become a stop string
        safe = len(text) - max((len(s) - 1 for s in stop), default=0)
        if safe > held:
            yield text[held:safe]
            held = safe
        if session.positions[slot] >= session.ctx:
            st.stop = "context"
            break
        logits = session.step(tok, slot)
    if st.stop != "stop string" and len(text) > held:
        yield text[held:]  # the held-back tail never became a stop string
    st.decode_s = time.perf_counter() - t1
