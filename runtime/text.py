"""Text in and out of an LLM bundle: the tokenizer the bundle carries (``tokenizer.json``
stored as a u8 tensor of its weight section, so it is mapped and checksummed like the
weights), its chat template (jinja2), and streaming detokenization.

Both libraries are device dependencies (``tokenizers`` and ``jinja2``), imported only
when a bundle's text is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

TOKENIZER = "tokenizer.json"  # the weight-section entry


class TextError(ValueError):
    """The bundle cannot turn text into tokens or back (no tokenizer, no template)."""


def load_tokenizer(weights: Mapping[str, np.ndarray]):
    """The ``tokenizers.Tokenizer`` a bundle carries, or TextError."""
    if TOKENIZER not in weights:
        raise TextError("this bundle carries no tokenizer (its model folder had none)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TextError(
            "this runtime lacks the tokenizers package (pip install 'edgepack[llm]')"
        ) from None
    return Tokenizer.from_str(bytes(weights[TOKENIZER]).decode("utf-8"))


class TextCodec:
    def __init__(self, manifest: Mapping, weights: Mapping[str, np.ndarray]) -> None:
        self.tok = load_tokenizer(weights)
        info = manifest["llm"].get("text", {})
        self.template = info.get("chat_template")
        self.bos, self.eos = info.get("bos_token"), info.get("eos_token")
        self.eos_ids = set(info.get("eos_ids", []))
        self._compiled = None  # the chat template's jinja2 Template, made on first use

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special``: the tokenizer's own additions (BOS...)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of a conversation, by the model's chat template, ready for the
        assistant's turn."""
        if not self.template:
            raise TextError("this model has no chat template (use a plain prompt)")
        template = self._template()  # TextError without jinja2
        import jinja2

        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=True,
                bos_token=self.bos or "",
                eos_token=self.eos or "",
            )
        except jinja2.TemplateError as e:
            raise TextError(f"chat template: {e}") from None

    def _template(self):
        """The chat template compiled once (compiling took ~7 ms of every chat request
        on the serving thread: SmolLM2's template, Zen 2)."""
        if self._compiled is None:
            try:
                import jinja2
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise TextError("this runtime lacks jinja2 (pip install 'edgepack[llm]')") from None

            def raise_exception(msg: str):
                raise TextError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.template)
            except jinja2.TemplateError as e:
                raise TextError(f"chat template: {e}") from None
        return self._compiled


class Detokenizer:
    """Text pieces as tokens arrive: the decoded text's new suffix, held back while it
    ends inside a multi-byte character (a lone U+FFFD).

    Each push decodes a short window, not the whole sequence (which made a long
    generation quadratic): the tokens of the last emitted piece as context (decoders
    join tokens with spaces, or drop a leading one, depending on their neighbours),
    then the tokens not emitted yet; the piece is what they add to the context's text
    (the incremental detokenization vLLM and text-generation-inference use)."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.ids = codec, []
        self.prefix = self.read = 0  # the context's start; the unemitted tokens' start

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
