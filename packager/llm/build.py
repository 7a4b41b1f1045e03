"""Pack a Hugging Face decoder folder into an LLM bundle.

The bundle's top-level ``graph``/``plan`` are the decode step (one row per sequence
slot); ``llm.prefill`` holds the prompt-chunk graph and its plan, and
``llm.decode_rows`` decode steps of fewer rows (1, 2, 4... under the slots: each row
names its slot, so a step runs the smallest graph that holds its sequences). All plans
put the KV cache (the graphs' state) first in the arena at the same offsets and are
given the same arena size, so the runtime binds them to one arena: the cache the prefill
fills is the one decode reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ...kernels import registry
from ...kernels.cpu.abi import XQ_BLOCK
from ...kernels.ops import WEIGHT_OPS
from ...kernels.wtypes import DEFAULT_GROUP, QUANT_MODES, bf16_to_f32, by_quant
from ...runtime.errortable import format_error_table
from ...runtime.text import TOKENIZER
from ..build import BuildResult, build_info
from ..ir import Graph, PackError
from ..layout import interleave_rows, rows16_fit
from ..manifest import make_manifest
from ..plan import plan_memory, tensor_bytes
from ..quantize import quantize_graph
from ..writer import write_bundle
from . import ACT_QUANT, DEFAULT_CHUNK, DEFAULT_CTX, KV_DTYPES
from .arch import decoder_spec
from .graph import (
    EMBED,
    ROPE_COS,
    ROPE_LOCAL_COS,
    ROPE_LOCAL_SIN,
    ROPE_SIN,
    decoder_graph,
    fused_weights,
)
from .hf import load_folder, load_text
from .rope import tables

# GGUF tensor types -> the --quant a GGUF file gets by default (its most common type's)
_GGUF_QUANT = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "Q8_0": "int8"}


def _quant_of(types: dict) -> str:
    """The mode nearest a GGUF file's precision: its most common weight type (the norms
    are F32 in every file, so F32 counts only when nothing else is there)."""
    weights = {t: n for t, n in types.items() if t != "F32"} or types
    top = max(weights, key=weights.get)
    return _GGUF_QUANT.get(top, "int4" if top.startswith(("Q4", "Q3", "Q2", "IQ")) else "int8")


def _int8_activations(mode: str, backends: Sequence[str], features=None) -> bool:
    if mode != "auto":
        return mode == "int8"
    k = registry.lookup("linear", "i4", backends[0])
    if k is None or not k.accepts({"xq": XQ_BLOCK}):
        return False
    from ...kernels.cpu.qdot import dot_isa
    from ...kernels.cpu.simd import host_features

    feats = set(features) if features is not None else host_features()
    return dot_isa(feats) != "generic"  # plain widening products lose to floats


def _as_f32(weights: dict) -> Callable[[str], np.ndarray]:
    def w(name: str) -> np.ndarray:
        if name not in weights:
            raise PackError(f"the model folder has no tensor {name!r}")
        a, st = weights[name]
        if st == "BF16":
            return bf16_to_f32(a)
        if st not in ("F32", "F16"):
            raise PackError(f"tensor {name!r} is {st}; expected F32, F16 or BF16")
        return np.ascontiguousarray(a, np.float32)

    return w


# Row counts of the smaller decode graphs a bundle carries (those under its --slots).
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def _graph_and_plan(g: Graph, plan) -> dict:
    m = make_manifest(g, plan)
    return {"graph": m["graph"], "plan": m["plan"]}


def build_llm(
    folder: str | Path,
    out: str | Path,
    quant: str | None = None,
    quant_embed: str | None = None,
    group_size: int = DEFAULT_GROUP,
    ctx: int = DEFAULT_CTX,
    slots: int = 1,
    chunk: int = DEFAULT_CHUNK,
    kv: str = "f16",
    backends: Sequence[str] = ("cpu", "ref"),
    act_quant: str = "auto",
    max_error: float | None = None,
    log: Callable[[str], None] = print,
    extra_manifest: dict | None = None,
    cpu_features: Sequence[str] | None = None,
) -> BuildResult:
    """``act_quant``: ``int8`` quantizes the activations int4 linears read to int8 in
    blocks of 32 (the ``xq`` attribute: integer products, ggml's Q8_0 activations),
    ``none`` keeps them float32; ``auto`` takes int8 where the first backend has the
    integer product and the CPU an integer dot instruction (VNNI, AVX2, dotprod).
    A quantized build measures itself against fp32 on a shipped text (evaluate.py) and
    records the table; ``max_error`` fails it when the mean KL divergence exceeds it.
    ``cpu_features`` (LLVM names: a target's) stand for the host's in ``auto``."""
    t0 = time.perf_counter()
    if act_quant not in ACT_QUANT:
        raise PackError(f"--act-quant {act_quant!r}: choose from {', '.join(ACT_QUANT)}")
    for q in (quant, quant_embed):
        if q is not None and q not in QUANT_MODES:
            raise PackError(f"--quant {q!r}; choose from {', '.join(QUANT_MODES)}")
    if kv not in KV_DTYPES:
        raise PackError(f"--kv {kv!r}: choose from {', '.join(KV_DTYPES)}")
    if min(ctx, slots, chunk) < 1:
        raise PackError("--ctx, --slots and the prefill chunk must be at least 1")
    source = Path(folder)
    if source.suffix == ".gguf":
        from .gguf_file import load_gguf

        config, weights, tokenizer, text, arrived = load_gguf(source)
        if quant is None:  # the file's own precision, as near as the table has it
            quant = _quant_of(arrived)
    else:
        config, weights = load_folder(source)
        tokenizer, text = load_text(source, config)
        arrived = {}
    quant = quant or "fp32"
    spec = decoder_spec(config)
    log(
        f"[1/4] {spec.arch}: {spec.layers} layers, width {spec.hidden}, {spec.heads} heads / "
        f"{spec.kv_heads} kv heads of {spec.head_dim}, vocab {spec.vocab} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    if ctx > spec.max_positions:
        log(f"      --ctx {ctx} is beyond the model's {spec.max_positions} trained positions")
    consts = fused_weights(spec, _as_f32(weights))
    consts[ROPE_COS], consts[ROPE_SIN] = tables(spec, ctx)
    if spec.rope_local_theta:  # Gemma 3's sliding layers rotate with their own base
        local = replace(spec, rope_theta=spec.rope_local_theta, rope=spec.rope_local)
        consts[ROPE_LOCAL_COS], consts[ROPE_LOCAL_SIN] = tables(local, ctx)
    # The embedding table and the output projection take --quant-embed (llama.cpp
    # keeps them wider than the layers, too); a tied table gets one type both take.
    embed_mode = {EMBED: quant_embed or quant, "lm_head.weight": quant_embed or quant}
    # Decode graphs for fewer rows than slots too: a step runs the smallest that holds
    # its sequences (rows carry their slot), so one stream on a 16-slot bundle does not
    # pay for 16 rows (SmolLM2-135M int4, 2 threads: 78 ms a step for 16 rows, 8.9 ms
    # for one).
    few = [r for r in DECODE_ROWS if r < slots]
    graphs = {
        k: quantize_graph(decoder_graph(spec, consts, rows, ctx, slots, kv, k == "prefill"),
                          quant, 0, group_size, embed_mode)
        for k, rows in (("prefill", chunk), ("decode", slots),
                        *((f"decode{r}", r) for r in few))
    }  # fmt: skip
    integer = {"int4", "int8"} & {quant, quant_embed or quant}
    xq = bool(integer) and _int8_activations(act_quant, backends, cpu_features)
    rows16 = xq and registry.wants(backends, "interleave")
    if xq:
        # int8 activations on the int4 linears, and on the int8 ones where their
        # kernel (q8x16.py) takes them: weights interleaved by 16 rows, so only where
        # the backend interleaves and the shapes allow it
        for g in graphs.values():
            for n in g.nodes:
                wt = g.wtype(n.input("w")) if n.op == "linear" else None
                if wt == "i4" or (wt == "i8" and rows16 and rows16_fit(g, n)):
                    n.attrs["xq"] = XQ_BLOCK
            if rows16:
                interleave_rows(g)
    g0 = graphs["decode"]
    if tokenizer is not None:  # no node reads it; mapped and checksummed with the weights
        g0.consts[TOKENIZER] = np.frombuffer(tokenizer, np.uint8)
    else:
        log("      no tokenizer.json: the bundle takes and gives token ids only")
    types = Counter(g0.wtype(n.input("w")) for n in g0.nodes if n.op in WEIGHT_OPS)
    log(f"      weights: {', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}")
    log(f"[2/4] plan prefill ({chunk} rows) and decode ({', '.join(map(str, few + [slots]))} "
        "rows)")
    plans = {k: plan_memory(g, backends) for k, g in graphs.items()}
    arena = max(p.arena_bytes for p in plans.values())
    for p in plans.values():
        p.arena_bytes = arena  # one arena for both graphs
    kv_bytes = sum(tensor_bytes(g0, t) for t in g0.state)
    log(
        f"      arena {arena / 1e6:.2f} MB, of which KV cache {kv_bytes / 1e6:.2f} MB "
        f"({slots} slot(s) x {ctx} positions, {kv})"
    )
    error = None
    if (quant, quant_embed or quant) != ("fp32", "fp32"):
        from .evaluate import EVAL_TOKENS, eval_tokens, evaluate

        ids, what = eval_tokens(tokenizer, spec.vocab, min(EVAL_TOKENS, ctx))
        log(f"      measure the error against fp32 on {what}")
        ref = decoder_graph(spec, consts, slots, ctx, slots, kv)
        error = evaluate(ref, g0, ids, backends)
        error["calibration"] = what
        log(format_error_table(error, limit=8))
        if max_error is not None and error["kl"] > max_error:
            raise PackError(
                f"mean KL divergence {error['kl']:.3e} from the fp32 model exceeds "
                f"--max-error {max_error:g}; try a wider --quant or --quant-embed"
            )
    prefill = make_manifest(graphs["prefill"], plans["prefill"])
    llm = {
        "spec": asdict(spec),
        "ctx": ctx,
        "slots": slots,
        "chunk": chunk,
        "kv_dtype": kv,
        "kv_bytes": kv_bytes,
        "text": text,
        "prefill": {"graph": prefill["graph"], "plan": prefill["plan"]},
        "decode_rows": {str(r): _graph_and_plan(graphs[f"decode{r}"], plans[f"decode{r}"])
                        for r in few},
    }  # fmt: skip
    extra = {
        "model": {"name": source.stem, "kind": "llm", "source_file": source.name},
        "build": build_info(),
        "quantization": {
            "mode": quant,
            **({"source_types": arrived} if arrived else {}),
            "embed": quant_embed or quant,
            "activations": "int8" if xq else "fp32",
            "scheme": by_quant(quant).describe,
            **({"error": error} if error else {}),
        }
        | ({"group_size": group_size} if "int4" in (quant, quant_embed) else {}),
        "llm": llm,
        **(extra_manifest or {}),
    }
    manifest = make_manifest(g0, plans["decode"], extra)
    log(f"[3/4] write {out}")
    size = write_bundle(out, manifest, g0.consts)
    wbytes = sum(v.nbytes for v in g0.consts.values())
    log(f"[4/4] {size / 1e6:.2f} MB bundle, done in {time.perf_counter() - t0:.1f}s")
    return BuildResult(Path(out), manifest, plans["decode"], size, wbytes, None)
