"""Choosing the next token from logits: greedy, or sampled after the usual filters.

Order (transformers' ``generate``): OpenAI's logit bias (added to the logits of the
tokens it names; -100 bans a token), repetition penalty on the logits of tokens already
in the sequence (divide positive logits by it, multiply negative ones), OpenAI's
frequency and presence penalties (subtract ``frequency * count + presence`` from the
logit of each token already in the sequence), then
temperature, then top-k, top-p (the smallest set of most likely tokens whose
probabilities reach p) and min-p (drop tokens below min_p times the top probability),
then one draw from the renormalised distribution. ``temperature == 0`` is greedy
(argmax, ties to the lowest id). A seed makes the draws reproducible: the sampler owns
its NumPy generator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("temperature and top_k must be >= 0, repetition_penalty > 0")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError("top_p must lie in (0, 1] and min_p in [0, 1]")
        self._rng = np.random.default_rng(self.seed)
        self._penalised = (self.repetition_penalty != 1.0 or self.presence_penalty != 0
                           or self.frequency_penalty != 0 or bool(self.logit_bias))  # fmt: skip
        self._bias_only = bool(self.logit_bias) and not (
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)
        if self.logit_bias:
            self._bias_ids = np.fromiter(self.logit_bias, np.int64)
            self._bias = np.fromiter(self.logit_bias.values(), np.float64)
        self._lowers_only = all(v <= 0 for v in (self.logit_bias or {}).values())

    def probabilities(self, logits: np.ndarray, seen: Iterable[int] = ()) -> np.ndarray:
        """The distribution a draw is made from (float64 [vocab]; one-hot when greedy)."""
        z = np.asarray(logits, np.float64).copy()
        if self.logit_bias:
            z[self._bias_ids] += self._bias
        if self.repetition_penalty != 1.0:
            ids = np.unique(np.fromiter(seen, np.int64))
            if ids.size:
                v = z[ids]
                z[ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if self.presence_penalty or self.frequency_penalty:
            ids, counts = np.unique(np.fromiter(seen, np.int64), return_counts=True)
            if ids.size:
                z[ids] -= self.frequency_penalty * counts + self.presence_penalty
        if self.temperature == 0:
            p = np.zeros_like(z)
            p[int(np.argmax(z))] = 1.0
            return p
        z /= self.temperature
        if self.top_k and self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z[z < kth] = -np.inf
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # the first always stays
            p[order[~keep]] = 0.0
        if self.min_p > 0.0:
            p[p < self.min_p * p.max()] = 0.0
        return p / p.sum()

    def __call__(self, logits: np.ndarray, seen: Iterable[int] = ()) -> int:
        """The next token id."""
        if self.temperature == 0 and not self._penalised:
            return int(np.argmax(logits))
        if self.temperature == 0 and self._bias_only:
            # greedy under a logit bias (a banned end of sequence): when every bias only
            # lowers and the top token has none, it stays on top (ties too: np.argmax
            # takes the first); else one float32 copy, not the float64 distribution
            # (0.5 ms a token over a 49k vocabulary)
            top = int(np.argmax(logits))
            if self._lowers_only and top not in self.logit_bias:
                return top
            z = np.array(logits, np.float32)
            z[self._bias_ids] += self._bias.astype(np.float32)
            return int(np.argmax(z))
        p = self.probabilities(logits, seen)
        if self.temperature == 0:
            return int(np.argmax(p))
        return int(self._rng.choice(p.size, p=p))
