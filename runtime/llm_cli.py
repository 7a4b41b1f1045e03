"""The ``generate`` command and the LLM lines of ``info`` (llama.cpp's habits: ``-p``,
``-n``, ``--temp``, ``--top-k``, ``--top-p``, ``--min-p``, ``--repeat-penalty``,
``--seed``, ``-t``; text streams to stdout, the speeds go to stderr)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping


def llm_summary(m: Mapping) -> list[str]:
    """``info`` lines of an LLM bundle."""
    llm = m["llm"]
    s = llm["spec"]
    text = llm.get("text", {})
    return [
        f"llm:      {s['arch']}, {s['layers']} layers, width {s['hidden']}, {s['heads']} heads "
        f"/ {s['kv_heads']} kv heads of {s['head_dim']}, ffn {s['ffn']}, vocab {s['vocab']}"
        + (", tied output" if s["tied"] else ""),
        f"context:  {llm['ctx']} positions x {llm['slots']} slot(s), prompt chunks of "
        f"{llm['chunk']}; KV cache {llm['kv_bytes'] / 1e6:.2f} MB ({llm['kv_dtype']}) in the arena",
        f"text:     {'chat template' if text.get('chat_template') else 'no chat template'}, "
        f"end ids {text.get('eos_ids', [])}",
    ]


def cmd_generate(a: argparse.Namespace) -> int:
    from .cli_io import pubkey
    from .generate import Stats, generate
    from .llm import LLMSession
    from .sampling import Sampler
    from .text import TextCodec

    if a.compute_device == "cuda" or a.require_gpu:
        raise ValueError("language-model bundles run on the cpu backend for now")
    s = LLMSession(a.bundle, threads=a.threads, require_signature=pubkey(a))
    codec = TextCodec(s.bundle.manifest, s.bundle.weights)
    prompt = a.prompt
    if a.chat:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}
        ]
        prompt = codec.chat(msgs)
    sampler = Sampler(a.temp, a.top_k, a.top_p, a.min_p, a.repeat_penalty, a.seed)
    st = Stats()
    for piece in generate(s, codec, prompt, a.n, sampler, a.stop or (), stats=st):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"prompt: {st.prompt_tokens} tokens, {st.prompt_tps:.1f} tok/s; decode: "
        f"{st.decode_tokens} tokens, {st.decode_tps:.1f} tok/s (stop: {st.stop})",
        file=sys.stderr,
    )
    return 0


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop below min-p x top (0: off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="(1: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop at this string (repeatable)")
