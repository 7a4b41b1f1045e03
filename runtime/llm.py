"""Run an LLM bundle: the prefill and decode graphs bound to one arena, whose KV cache
(the graphs' state, planned first in the arena) carries each sequence from one run to
the next.

``LLMSession`` is the token-level API: ``prefill(tokens, slot)`` feeds a prompt in
chunks of the planned size and returns the logits after its last token; ``step(token,
slot)`` feeds one token and returns the next logits. Positions are counted per slot;
``reset(slot)`` starts that sequence over (its old cache entries are never read again:
attention reads positions up to the current one only). Logits are float32 views owned by
the session, valid until its next run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .bundle import Bundle
from .executor import Executor
from .session import open_located
from .threads import set_threads


class LLMError(ValueError):  # a ValueError: the CLI reports it as an error line
    """A request the bundle cannot serve (not an LLM bundle, context full, bad token)."""


class LLMSession:
    def __init__(
        self,
        path: str | os.PathLike,
        threads: int | None = None,
        require_signature: bytes | None = None,
    ) -> None:
        set_threads(threads)
        # an already opened bundle (the CLI's, after a look at its manifest) or a path
        self.bundle = path if isinstance(path, Bundle) else open_located(path, require_signature)
        m = self.bundle.manifest
        if "llm" not in m:
            raise LLMError(f"{path}: not a language-model bundle (no llm section)")
        llm = m["llm"]
        self.spec = llm["spec"]
        self.ctx, self.slots, self.chunk = int(llm["ctx"]), int(llm["slots"]), int(llm["chunk"])
        self.decode = Executor(m, self.bundle.weights, device="cpu")
        pre = {**m, "graph": llm["prefill"]["graph"], "plan": llm["prefill"]["plan"]}
        self.prefill_ex = Executor(
            pre, self.bundle.weights, device=self.decode.device, arena=self.decode.arena
        )
        self.positions = [0] * self.slots
        self._feeds = {
            k: {n: np.zeros(rows, np.int32) for n in ("ids", "pos", "slot")}
            for k, rows in (("prefill", self.chunk), ("decode", self.slots))
        }
        # Decode steps by row count: the full graph (a row per slot) and the smaller ones
        # the bundle carries; a step runs the smallest that holds its sequences, each row
        # naming its slot. Rows and feeds are made once: a step allocates nothing.
        (logits,) = self.decode.host_outputs()
        self._decoders = {self.slots: (self.decode, self._feeds["decode"], list(logits))}
        for r, g in llm.get("decode_rows", {}).items():
            ex = Executor({**m, "graph": g["graph"], "plan": g["plan"]}, self.bundle.weights,
                          device=self.decode.device, arena=self.decode.arena)  # fmt: skip
            (out,) = ex.host_outputs()
            feeds = {n: np.zeros(int(r), np.int32) for n in ("ids", "pos", "slot")}
            self._decoders[int(r)] = (ex, feeds, list(out))
        self._sizes = sorted(self._decoders)
        # every layer's key and value cache, [slots, ctx, kv heads, head dim] (share)
        self._caches = [self.decode.views[n] for n in m["graph"].get("state", [])]
        self._one = self._decoders[self._sizes[0]]

    @property
    def vocab(self) -> int:
        return int(self.spec["vocab"])

    def reset(self, slot: int = 0) -> None:
        self.keep(slot, 0)

    def keep(self, slot: int, n: int) -> None:
        """Cut sequence ``slot`` back to its first ``n`` positions: the next token goes
        to position ``n``, and the cached keys and values before it are kept (a prompt
        that starts with the tokens the slot held reuses them)."""
        self._slot(slot)
        if not 0 <= n <= self.positions[slot]:
            raise LLMError(f"slot {slot} holds {self.positions[slot]} positions, not {n}")
        self.positions[slot] = n

    def share(self, src: int, dst: int, n: int) -> None:
        """Start sequence ``dst`` with the first ``n`` positions of sequence ``src``: their
        keys and values are copied, every layer (SmolLM2, f16 cache: 23 KB a position),
        so a prompt that starts like another sequence skips computing them. ``dst`` then
        holds exactly those ``n`` positions; ``src`` is unchanged."""
        self._slot(src)
        self._slot(dst)
        if src == dst or not 0 <= n <= self.positions[src]:
            raise LLMError(f"share: slot {src} holds {self.positions[src]} positions; "
                           f"{n} of them cannot go to slot {dst}")  # fmt: skip
        for c in self._caches:
            c[dst, :n] = c[src, :n]
        self.positions[dst] = n

    def _slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise LLMError(f"slot {slot}: the bundle has slots 0..{self.slots - 1}")

    def _tokens(self, tokens, slot: int) -> np.ndarray:
        self._slot(slot)
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= self.vocab):
            raise LLMError(f"token ids must lie in 0..{self.vocab - 1}")
        if self.positions[slot] + t.size > self.ctx:
            raise LLMError(
                f"slot {slot}: {self.positions[slot]} + {t.size} tokens exceed the "
                f"context of {self.ctx} (rebuild with a larger --ctx)"
            )
        return t

    def prefill(self, tokens, slot: int = 0) -> np.ndarray:
        """Feed ``tokens`` to sequence ``slot`` after what it already holds; the logits
        [vocab] after the last of them."""
        t = self._tokens(tokens, slot)
        if not t.size:
            raise LLMError("prefill of no tokens")
        logits = None
        for c0 in range(0, t.size, self.chunk):
            logits = self._prefill_chunk([(slot, t[c0 : c0 + self.chunk])])[-1]
        return logits

    def prefill_many(self, parts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """One prompt-chunk run holding the next tokens of several sequences: ``parts``
        is (slot, tokens) with distinct slots and at most ``chunk`` tokens together.
        Each row names its slot and position, and the attention stores every row's key
        and value before any row attends, so prompts packed together read only their
        own sequence. No logits: a caller feeds each prompt's last token through a
        decode step (``step_rows``), which gives them."""
        ts = [(slot, self._tokens(tokens, slot)) for slot, tokens in parts]
        n = sum(t.size for _, t in ts)
        slots = [slot for slot, _ in ts]
        if not n or n > self.chunk or len(set(slots)) != len(slots):
            raise LLMError(f"prefill_many: {n} tokens of slots {slots} (1 to {self.chunk} "
                           "tokens, distinct slots)")  # fmt: skip
        self._prefill_chunk(ts)

    def _prefill_chunk(self, parts: Sequence[tuple[int, np.ndarray]]) -> np.ndarray:
        """Run the prompt-chunk graph on ``parts`` ((slot, checked tokens), at most
        ``chunk`` together) in its last rows, each at its sequence's next positions, and
        advance them; the graph's logits output. The last token is the graph's last
        row (the one whose logits a bundle's prefill computes; older bundles give every
        row's). Idle rows (slot -1) store and attend nothing."""
        f = self._feeds["prefill"]
        lo = self.chunk - sum(t.size for _, t in parts)
        f["ids"][:lo], f["pos"][:lo], f["slot"][:lo] = 0, 0, -1
        for slot, t in parts:
            start = self.positions[slot]
            f["ids"][lo : lo + t.size] = t
            f["pos"][lo : lo + t.size] = np.arange(start, start + t.size)
            f["slot"][lo : lo + t.size] = slot
            lo += t.size
        (out,) = self.prefill_ex.run_views(f)
        for slot, t in parts:
            self.positions[slot] += t.size
        return out

    def step(self, token: int, slot: int = 0) -> np.ndarray:
        """Feed one token to sequence ``slot``; the logits [vocab] after it (the same
        arena view every time: read it before the next run). The steady-state decode
        loop: checks by comparison, writes into fixed buffers, allocates nothing."""
        if not (0 <= slot < self.slots and 0 <= token < self.vocab) or (
            self.positions[slot] >= self.ctx
        ):
            self._tokens([token], slot)  # raises, naming what is wrong
        ex, f, rows = self._one
        f["slot"].fill(-1)
        f["ids"][0], f["pos"][0], f["slot"][0] = token, self.positions[slot], slot
        ex.run_views(f)
        self.positions[slot] += 1
        return rows[0]

    def step_many(self, slots: Sequence[int], tokens: Sequence[int],
                  rows: int = 0) -> list[np.ndarray]:  # fmt: skip
        """One decode run for several sequences: ``tokens[i]`` to sequence ``slots[i]``
        (distinct slots), on the smallest decode graph of at least ``rows`` rows that
        holds them (row i carries slot i's token), so the projections are one product
        over the rows, not one per sequence. Returns each sequence's logits [vocab]
        (arena views, valid until the next run).

        Graphs of different row counts may round differently in the last bits (their
        products are blocked differently); a caller that wants a sequence's tokens not
        to depend on what runs beside it passes the same ``rows`` every time."""
        return self.step_rows([(slot, [token]) for slot, token in zip(slots, tokens)], rows)

    @property
    def max_rows(self) -> int:
        """The rows of the largest decode graph (one per slot)."""
        return self._sizes[-1]

    def step_rows(self, items: Sequence[tuple[int, Sequence[int]]],
                  rows: int = 0) -> list[np.ndarray]:  # fmt: skip
        """``step_many`` where a sequence may bring several tokens: ``items`` is (slot,
        tokens), distinct slots, at most ``max_rows`` tokens together, laid out row
        after row. The attention stores every row's key and value before any row
        attends, so a prompt's remaining tokens can ride in the same run as the other
        sequences' next tokens (the serving engine's mixed steps). Returns the logits
        after each item's last token."""
        k = sum(len(t) for _, t in items)
        slots = [slot for slot, _ in items]
        if not items or len(set(slots)) != len(slots) or k > self.max_rows or any(
            len(t) == 0 for _, t in items
        ):
            raise LLMError(f"step_rows: {k} tokens of slots {slots} (1 to {self.max_rows} "
                           "tokens, distinct slots, none empty)")  # fmt: skip
        for slot, tokens in items:
            if len(tokens) == 1:  # the steady-state case: checks by comparison
                if not (0 <= slot < self.slots and 0 <= tokens[0] < self.vocab) or (
                    self.positions[slot] >= self.ctx
                ):
                    self._tokens(tokens, slot)  # raises, naming what is wrong
            else:
                self._tokens(tokens, slot)
        ex, f, out = self._decoders[next((r for r in self._sizes if r >= max(k, rows)),
                                         self._sizes[-1])]  # fmt: skip
        f["slot"].fill(-1)
        f["ids"].fill(0)
        f["pos"].fill(0)
        i, last = 0, []
        for slot, tokens in items:
            p = self.positions[slot]
            for token in tokens:
                f["ids"][i], f["pos"][i], f["slot"][i] = token, p, slot
                i += 1
                p += 1
            last.append(i - 1)
        ex.run_views(f)
        for slot, tokens in items:
            self.positions[slot] += len(tokens)
        return [out[j] for j in last]
