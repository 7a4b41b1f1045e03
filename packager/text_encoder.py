"""A text encoder's bundle section (``--tokenizer``): which graph inputs take the token
ids, the attention mask and the token types, which output holds the embeddings, and
how token vectors become one vector per text (docs/http.md, ``/v1/embeddings``).

Decided here, at pack time, from the ONNX graph and the tokenizer, and checked: the
runtime (runtime/embed.py) only reads the section. Inputs are recognised by the names
exporters give them (Hugging Face's ``input_ids``, ``attention_mask``,
``token_type_ids``); an integer input of any other name is refused with its name, as
the server could not fill it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .ir import Graph, PackError

POOLINGS = ("auto", "mean", "cls", "none")
INT_DTYPES = ("i64", "i32")

# exporters' names for each role (lower case); the first input matching a role takes it
_ROLES = {
    "input_ids": ("input_ids", "ids", "input", "tokens", "token_ids"),
    "attention_mask": ("attention_mask", "mask", "input_mask"),
    "token_type_ids": ("token_type_ids", "segment_ids", "type_ids"),
}
# outputs that already hold one vector per text, in order of preference
_POOLED = ("sentence_embedding", "embeddings", "embedding", "text_embeds", "pooled")


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency of the packager
        raise PackError("--tokenizer needs the tokenizers package") from None
    try:
        raw = path.read_bytes()
        return raw, Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as e:
        raise PackError(f"--tokenizer {path}: {e.strerror or e}") from None
    except Exception as e:  # tokenizers raises its own Exception type
        raise PackError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from None


def _pad_id(raw: bytes, tok) -> int:
    """tokenizer.json's padding id, else its [PAD] / <pad> token, else 0 (masked out
    whatever it is)."""
    pad = (json.loads(raw).get("padding") or {}).get("pad_id")
    if isinstance(pad, int):
        return pad
    for t in ("[PAD]", "<pad>", "<|padding|>"):
        if tok.token_to_id(t) is not None:
            return int(tok.token_to_id(t))
    return 0


def text_encoder_section(
    g: Graph, tokenizer: str | Path, pooling: str = "auto", output: str | None = None
) -> tuple[dict, np.ndarray]:
    """(the manifest's ``text_encoder`` section, tokenizer.json as the u8 tensor the
    bundle carries) for the imported graph ``g``, or PackError naming what does not fit."""
    if pooling not in POOLINGS:
        raise PackError(f"--pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
    raw, tok = _tokenizer(Path(tokenizer))
    roles: dict[str, str] = {}
    for name in g.inputs:
        if g.dtype(name) not in INT_DTYPES or len(g.shapes[name]) != 2:
            raise PackError(
                f"--tokenizer: input {name!r} ({g.dtype(name)} {list(g.shapes[name])}) is not "
                "a [batch, tokens] integer tensor; a text encoder takes token ids, an "
                "attention mask and token types only"
            )
        role = next((r for r, names in _ROLES.items() if name.lower() in names
                     and r not in roles), None)  # fmt: skip
        if role is None:
            raise PackError(
                f"--tokenizer: input {name!r} is neither token ids, an attention mask nor "
                f"token types (names: {', '.join(n for v in _ROLES.values() for n in v)})"
            )
        roles[role] = name
    if "input_ids" not in roles:
        raise PackError(f"--tokenizer: no token-id input among {g.inputs} (e.g. 'input_ids')")
    if "attention_mask" not in roles:
        raise PackError(
            "--tokenizer: the model has no attention-mask input, so texts shorter than its "
            f"{g.shapes[roles['input_ids']][1]} tokens could not be padded"
        )
    shape = g.shapes[roles["input_ids"]]
    for name in roles.values():
        if g.shapes[name] != shape:
            raise PackError(f"--tokenizer: input {name!r} has shape {list(g.shapes[name])}, "
                            f"token ids {list(shape)}")  # fmt: skip
    batch, seq = shape
    floats = [o for o in g.outputs if g.dtype(o) == "f32"]
    if output is None:
        pooled = [o for o in floats if len(g.shapes[o]) == 2]
        named = [o for key in _POOLED for o in pooled if o.lower() == key]
        tokens = [o for o in floats if len(g.shapes[o]) == 3]
        # a rank-2 output of another name may be BERT's pooler_output (the [CLS] vector
        # through a dense layer and tanh, not a sentence embedding): token vectors first
        pick = tokens if pooling in ("mean", "cls") else named or tokens or pooled
        if not pick:
            want = ("[batch, tokens, dim]" if pooling in ("mean", "cls")
                    else "[batch, dim] or [batch, tokens, dim]")  # fmt: skip
            raise PackError(f"--tokenizer --pooling {pooling}: no float32 output of shape "
                            f"{want} among {g.outputs}")  # fmt: skip
        output = pick[0]
    elif output not in g.outputs:
        raise PackError(f"--embedding-output {output!r} is not an output ({g.outputs})")
    oshape = g.shapes[output]
    if pooling == "auto":
        pooling = "none" if len(oshape) == 2 else "mean"
    want = (batch, seq) if pooling != "none" else (batch,)
    if g.dtype(output) != "f32" or tuple(oshape[: len(want)]) != want or \
            len(oshape) != len(want) + 1:  # fmt: skip
        what = "[batch, dim]" if pooling == "none" else "[batch, tokens, dim]"
        raise PackError(f"--pooling {pooling}: output {output!r} is {g.dtype(output)} "
                        f"{list(oshape)}, not {what} with batch {batch}, tokens {seq}")  # fmt: skip
    section = {
        "input_ids": roles["input_ids"],
        "attention_mask": roles["attention_mask"],
        "token_type_ids": roles.get("token_type_ids"),
        "output": output,
        "pooling": pooling,
        "normalize": True,  # OpenAI's embeddings are unit vectors
        "max_tokens": int(seq),
        "dimensions": int(oshape[-1]),
        "pad_id": _pad_id(raw, tok),
        "vocab_size": int(tok.get_vocab_size(with_added_tokens=True)),
    }
    return section, np.frombuffer(raw, np.uint8)
