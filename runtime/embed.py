"""Text in, one vector per text out, for an encoder bundle packed with ``--tokenizer``
(the manifest's ``text_encoder`` section, decided by packager/text_encoder.py).

Texts are tokenized with the carried tokenizer.json (its own special tokens: BERT's
[CLS] ... [SEP]), padded to the bundle's fixed token count with the attention mask
zero over the padding, run through the scheduler like any tensor job, and pooled here:
``mean`` over the unmasked tokens (sentence-transformers' default), ``cls`` (the first
token), or ``none`` (the graph pools itself); then L2-normalised, as OpenAI's
embeddings are. A text longer than the bundle takes is refused, as OpenAI refuses one
past its context, rather than silently cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .executor import DTYPES
from .text import TextError, load_tokenizer


class TextEncoder:
    def __init__(self, manifest: Mapping, weights: Mapping[str, np.ndarray]) -> None:
        info = manifest["text_encoder"]
        self.tok = load_tokenizer(weights)
        self.tok.no_truncation()  # a long text is an error, not a silent cut
        self.tok.no_padding()
        self.ids_name, self.mask_name = info["input_ids"], info["attention_mask"]
        self.types_name = info.get("token_type_ids")
        self.output, self.pooling = info["output"], info["pooling"]
        self.normalize = bool(info["normalize"])
        self.max_tokens, self.dimensions = int(info["max_tokens"]), int(info["dimensions"])
        self.pad_id, self.vocab = int(info["pad_id"]), int(info["vocab_size"])
        ins = {t["name"]: t for t in manifest["graph"]["inputs"]}
        roles = [self.ids_name, self.mask_name] + ([self.types_name] if self.types_name else [])
        if set(roles) != set(ins) or info["output"] not in {
            t["name"] for t in manifest["graph"]["outputs"]
        }:
            raise TextError(f"text_encoder section names {roles} -> {self.output!r}, the graph "
                            f"{sorted(ins)}")  # fmt: skip
        self.dtypes = {n: DTYPES[ins[n]["dtype"]] for n in roles}

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=True)]

    def check(self, seqs: Sequence[Sequence[int]]) -> None:
        """TextError naming the first sequence the bundle cannot take."""
        for i, s in enumerate(seqs):
            if not s:
                raise TextError(f"input {i} is empty (no token ids)")
            if len(s) > self.max_tokens:
                raise TextError(
                    f"input {i} has {len(s)} tokens; this model takes 1 to {self.max_tokens} "
                    "(split longer texts)"
                )
            bad = next((t for t in s if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise TextError(f"input {i}: token id {bad} is outside the vocabulary "
                                f"(0..{self.vocab - 1})")  # fmt: skip

    def feeds(self, seqs: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        """The graph's inputs for these token sequences: [len(seqs), max_tokens] each,
        padded on the right."""
        n = len(seqs)
        ids = np.full((n, self.max_tokens), self.pad_id, np.int64)
        mask = np.zeros((n, self.max_tokens), np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        out = {self.ids_name: ids, self.mask_name: mask}
        if self.types_name:
            out[self.types_name] = np.zeros_like(ids)
        return {k: v.astype(self.dtypes[k], copy=False) for k, v in out.items()}

    def pool(self, out: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[n, dimensions] float32 from the output rows and the attention mask."""
        if self.pooling == "mean":
            m = mask.astype(np.float64)[:, :, None]
            v = (out.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        elif self.pooling == "cls":
            v = out[:, 0, :].astype(np.float64)
        else:
            v = out.astype(np.float64)
        if self.normalize:
            v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return v.astype(np.float32)
