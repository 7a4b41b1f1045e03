"""The pack pipeline: import -> optimise -> quantize -> plan -> check error -> write."""

from __future__ import annotations

import copy
import functools
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..kernels.ops import WEIGHT_OPS
from ..kernels.registry import wants
from ..kernels.wtypes import DEFAULT_GROUP, by_quant
from ..runtime.errortable import format_error_table
from ..runtime.executor import DTYPES, Executor, seeded_feeds
from ..runtime.text import TOKENIZER
from .act_quant import ACT_SCHEME, activation_ranges, int8_codes, quantize_conv_inputs
from .conv_algo import choose_conv_algorithms
from .fuse import optimise
from .ir import Graph, PackError
from .layout import choose_layouts, pack_panels
from .llm import ACT_QUANT
from .manifest import make_manifest
from .mbconv import fuse_mbconv
from .onnx_import import import_onnx
from .plan import Plan, plan_memory
from .precision import keep_sensitive, measured_tensors, output_cosine, quantized_weights
from .quantize import (
    DEFAULT_MIN_WEIGHTS,
    INT8_ACT_MIN_MACS,
    MODES,
    busy_small_weights,
    error_table,
    quantize_graph,
)
from .text_encoder import text_encoder_section
from .writer import write_bundle

DEFAULT_CALIB_SAMPLES = 8
# The output cosine (with fp32, on the calibration inputs) a quantized build keeps
# layers float32 to reach: the accuracy ONNX Runtime's int8 reaches on the models of
# tests/test_e2e_models.py (issue 18).
DEFAULT_MIN_COSINE = 0.99


@dataclass
class BuildResult:
    path: Path
    manifest: dict
    plan: Plan
    bundle_bytes: int
    weight_bytes: int
    error: dict | None


def load_calibration(
    path: str | Path | None, g: Graph, samples: int = DEFAULT_CALIB_SAMPLES, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """Calibration feeds: from an npz keyed by input name (each array cast to its
    input's dtype), else seeded ones (runtime/executor.py seeded_feeds).

    An array may be ``[S, *input_shape]`` (S feeds) or stack samples along the batch
    axis (``[n, *input_shape[1:]]``), which are grouped into feeds of the bundle's
    batch size (the last group wraps around to fill up).
    """
    if path is None:
        rng = np.random.default_rng(seed)
        specs = [{"name": t, "dtype": g.dtype(t), "shape": g.shapes[t]} for t in g.inputs]
        return [seeded_feeds(specs, rng) for _ in range(samples)]
    if not str(path).endswith(".npz") or not Path(path).is_file():
        raise PackError(f"--calib {path}: expected an existing .npz keyed by input name")
    data = np.load(path)
    missing = [t for t in g.inputs if t not in data.files]
    if missing:
        raise PackError(f"--calib {path}: missing inputs {missing}; it has {data.files}")
    per_input = {}
    for t in g.inputs:
        a = np.asarray(data[t], DTYPES[g.dtype(t)])
        shape = g.shapes[t]
        if a.shape[1:] == shape:
            per_input[t] = list(a)
        elif a.ndim == len(shape) and a.shape[1:] == shape[1:] and len(a):
            b = shape[0]
            groups = -(-len(a) // b)
            idx = np.arange(groups * b) % len(a)
            per_input[t] = list(a[idx].reshape((groups,) + shape))
        else:
            raise PackError(
                f"--calib {path}: {t} has shape {a.shape}; expected "
                f"[samples, {', '.join(map(str, shape))}] or "
                f"[n, {', '.join(map(str, shape[1:]))}]"
            )
    n = min(len(v) for v in per_input.values())
    return [{t: per_input[t][i] for t in g.inputs} for i in range(n)]


def build_info() -> dict:
    import onnx

    return {
        "edgepack": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "onnx": onnx.__version__,
        "machine": platform.machine(),
    }


# the convs each int8 node computes (a qmbconv chain: its expansion, depthwise conv and
# projection), for the manifest's count of convs taking u8 activations
_INT8_CONVS = {"qconv": 1, "qdwconv": 1, "qmbconv": 3}


def _layouts(
    g: Graph,
    backends: Sequence[str],
    layout: str,
    ranges: Mapping[str, tuple[float, float]] | None = None,
    chains: bool = True,
) -> tuple[int, int, int, tuple[int, int, int]]:
    """The layout passes, in order (each counts what it changed): channels-last
    regions, weight panels for their convs, u8 inputs for the int8 convs whose input
    has a calibrated range in ``ranges`` and u8 codes between int8 ops (act_quant.py
    ``int8_codes``), then banded chains (of the convs left float:
    a chain's inner tensors are never materialized, so ``chains=False`` for the fp32
    graph the ranges are measured on)."""
    n_last = choose_layouts(g, backends, layout)
    n_panels = pack_panels(g) if wants(backends, "panels") else 0
    n_xq = quantize_conv_inputs(g, ranges) if ranges else 0
    n_dw, n_u8 = int8_codes(g, ranges) if n_xq else (0, 0)
    n_chains = fuse_mbconv(g, backends) if chains else 0
    return n_last, n_chains, n_panels, (n_xq, n_dw, n_u8)


def _measured(src: Graph, ref: Graph, q: Graph, log: Callable[[str], None]) -> list[str]:
    """What the mixed-precision search measures (precision.measured_tensors): the
    outputs, or for a ranked output the tensors its ranking reads, when both the fp32
    and the quantized bundle produce them (a fused-away tensor has no step)."""
    made = {o for n in ref.nodes for o in n.outputs} & {o for n in q.nodes for o in n.outputs}
    measured = measured_tensors(src)
    if measured == list(q.outputs) or not set(measured) <= made:
        return list(q.outputs)
    log(f"      ranked output(s) measured where the ranking reads: {', '.join(measured)}")
    return measured


def build(
    model: str | Path,
    out: str | Path,
    quant: str = "fp32",
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    calib: str | Path | None = None,
    max_error: float | None = None,
    min_weights: int = DEFAULT_MIN_WEIGHTS,
    group_size: int = DEFAULT_GROUP,
    backends: Sequence[str] = ("cpu", "ref"),
    extra_manifest: dict | None = None,
    conv_algo: str = "auto",
    layout: str = "auto",
    log: Callable[[str], None] = print,
    constant_inputs: Mapping[str, np.ndarray | str] | None = None,
    min_cosine: float | None = None,
    tokenizer: str | Path | None = None,
    pooling: str = "auto",
    embedding_output: str | None = None,
    act_quant: str = "auto",
) -> BuildResult:
    """Pack ``model`` into the bundle ``out``. ``min_cosine``: with a quantized mode,
    keep the most sensitive layers float32 until the outputs' cosine with fp32 on the
    calibration inputs reaches it (packager/precision.py); None: DEFAULT_MIN_COSINE
    with ``calib`` (real inputs), off without; 0: off. ``tokenizer``: a text encoder's
    tokenizer.json, carried with its ``pooling`` of ``embedding_output`` so that
    ``serve --http`` answers /v1/embeddings (packager/text_encoder.py). ``act_quant``
    ``int8`` with ``quant`` int8: convs also quantize their inputs to u8 from ranges
    measured on the calibration inputs (packager/act_quant.py); ``auto`` and ``none``
    keep them float32."""
    if quant not in MODES:
        raise PackError(f"--quant {quant!r}; choose from {', '.join(MODES)}")
    if act_quant not in ACT_QUANT:
        raise PackError(f"--act-quant {act_quant!r}: choose from {', '.join(ACT_QUANT)}")
    if min_cosine is None:  # seeded random inputs say little of what the data needs
        min_cosine = DEFAULT_MIN_COSINE if calib is not None else 0.0
    steps = 6
    t0 = time.perf_counter()

    def stage(i: int, what: str) -> None:
        log(f"[{i}/{steps}] {what} ({time.perf_counter() - t0:.1f}s)")

    stage(1, f"import {Path(model).name}")
    g = import_onnx(model, input_shapes, log=lambda s: log("      " + s),
                    constant_inputs=constant_inputs)
    n_onnx = len(g.nodes)
    carried: dict[str, np.ndarray] = {}  # tensors no node reads (a tokenizer)
    encoder = None
    if tokenizer is not None:
        encoder, carried[TOKENIZER] = text_encoder_section(g, tokenizer, pooling,
                                                           embedding_output)  # fmt: skip
        log(f"      text encoder: {encoder['pooling']} pooling of {encoder['output']!r} "
            f"({encoder['dimensions']} dims, up to {encoder['max_tokens']} tokens)")
    elif pooling != "auto" or embedding_output is not None:
        raise PackError("--pooling and --embedding-output go with --tokenizer")
    stage(2, "fold and fuse")
    stats = optimise(g)
    log(
        f"      {n_onnx} ops -> {len(g.nodes)} ops; "
        + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in stats.items() if v)
    )
    stage(3, f"quantize weights ({quant})")

    src = g  # the optimised graph each quantization starts from
    int8_acts = quant == "int8" and act_quant == "int8" and wants(backends, "act_quant")

    @functools.cache
    def fp32_reference() -> tuple[list, Graph, Executor]:
        """The calibration inputs and the fp32 graph with the same layouts as the
        quantized one (so both traces hold each tensor in the same order), made once."""
        feeds = load_calibration(calib, src)
        ref = copy.deepcopy(src)
        _layouts(ref, backends, layout, chains=not int8_acts)
        # On the host: the packager needs no GPU, and a cuda plan's recorded cpu
        # fallbacks compute the same function (checked kernel by kernel in the tests).
        ex = Executor(make_manifest(ref, plan_memory(ref)), ref.consts, device="cpu")
        return feeds, ref, ex

    ranges: dict[str, tuple[float, float]] = {}
    # quantize_graph's overrides for the small layers int8 activations take anyway
    busy = dict.fromkeys(busy_small_weights(src, min_weights), quant) if int8_acts else {}
    # Convs take u8 activations on request only (``auto`` keeps them float32): with
    # per-tensor min/max ranges, PP-OCRv4's recogniser reached 0.989 output cosine on
    # held-out pages (0.99 wanted) and the rapidocr classifier 194/200 top-1 agreement.
    if int8_acts:
        if calib is None:
            log("      int8 activations calibrated on seeded random inputs: pass --calib "
                "with real inputs")
        feeds, _, ref_exec = fp32_reference()
        ranges = activation_ranges(ref_exec, feeds)

    def quantize_and_plan(keep: set[str], say: Callable[[str], None]) -> tuple[Graph, Plan]:
        """Stages 3 and 4 with the weights in ``keep`` left float32."""
        q = quantize_graph(src, quant, min_weights, group_size,
                           overrides=busy | dict.fromkeys(keep, "fp32"))  # fmt: skip
        if quant != "fp32":
            small = [n.name for n in q.nodes if n.op in WEIGHT_OPS
                     and q.wtype(n.input("w")) == "f32" and n.input("w") not in keep]  # fmt: skip
            if small:
                say(f"      {len(small)} layer(s) under {min_weights} weights stay fp32")
            if busy:
                say(f"      {len(busy)} layer(s) under {min_weights} weights quantized for "
                    f"their int8 x int8 work (at least {INT8_ACT_MIN_MACS / 1e6:g} M MACs)")
        n_wino = choose_conv_algorithms(q, backends, conv_algo)
        if n_wino:
            say(f"      {n_wino} 3x3 conv(s) -> Winograd (weights stored transformed)")
        n_last, n_chains, n_panels, (n_xq, n_dw, n_u8) = _layouts(q, backends, layout, ranges)
        if n_last:
            say(f"      {n_last} op(s) run channels-last (NHWC)")
        if n_chains:
            say(f"      {n_chains} pointwise-depthwise-pointwise chain(s) run in bands of rows")
        if n_panels:
            say(f"      {n_panels} conv(s) and linear(s) store their weights as GEMM panels")
        if n_xq:
            say(f"      {n_xq} conv(s) take u8 activations (int8 x int8 products)")
        if n_u8:
            say(f"      {n_u8} output(s) written as the u8 codes of the int8 convs that read "
                f"them ({n_dw} by 3x3 depthwise convs)")
        return q, plan_memory(q, backends)

    q, plan = quantize_and_plan(set(), log)
    stage(4, "plan memory")
    log(
        f"      arena {plan.arena_bytes / 1e6:.2f} MB for {len(q.shapes)} tensors "
        f"(one buffer each would take {plan.naive_bytes / 1e6:.2f} MB)"
    )
    extra = {
        "model": {"name": Path(model).stem, "source_file": Path(model).name, **g.meta},
        "build": build_info(),
        "quantization": {"mode": quant, "min_weights": min_weights}
        | ({"group_size": group_size} if quant == "int4" else {}),
        **(extra_manifest or {}),
    }
    if encoder is not None:
        extra["text_encoder"] = encoder
    error = None
    if quant != "fp32":
        stage(5, "measure quantization error on calibration inputs")
        feeds, g, ref_exec = fp32_reference()
        q_exec = Executor(make_manifest(q, plan), q.consts, device="cpu")
        if min_cosine:
            measured = _measured(src, g, q, log)
            cos = output_cosine(ref_exec, q_exec, feeds, measured)
            if cos < min_cosine:
                log(f"      output cosine {cos:.4f} < --min-cosine {min_cosine}")

                def executor_for(keep: set[str]) -> Executor:
                    qv, pv = quantize_and_plan(keep, lambda s: None)
                    return Executor(make_manifest(qv, pv), qv.consts, device="cpu")

                plain = quantize_graph(src, quant, min_weights, group_size, busy)  # before layouts
                keep, cos = keep_sensitive(src, quantized_weights(src, plain), executor_for,
                                           ref_exec, feeds, min_cosine, log, start=cos,
                                           tensors=measured)  # fmt: skip
                if keep:
                    q, plan = quantize_and_plan(set(keep), lambda s: None)
                    q_exec = Executor(make_manifest(q, plan), q.consts, device="cpu")
                    kb = sum(src.consts[w].size for w in keep) * 4 / 1e3
                    log(f"      {len(keep)} sensitive layer(s) stay fp32 ({kb:.0f} KB): "
                        f"output cosine {cos:.4f}")  # fmt: skip
                    extra["quantization"]["kept_fp32"] = keep
        nodes = make_manifest(q, plan)["graph"]["nodes"]
        error = error_table(ref_exec, q_exec, feeds, nodes, q.outputs)
        error["calibration"] = str(calib) if calib else f"{len(feeds)} seeded random inputs"
        log(format_error_table(error))
        extra["quantization"].update(
            {
                "scheme": by_quant(quant).describe,
                "error": error,
            }
        )
        n_xq = sum(_INT8_CONVS.get(n.op, 0) for n in q.nodes)
        if n_xq:
            extra["quantization"]["activations"] = {"scheme": ACT_SCHEME, "convs": n_xq}
        if max_error is not None and error["max_output_rel_l2"] > max_error:
            raise PackError(
                f"quantization error {error['max_output_rel_l2']:.3e} (relative L2 of the "
                f"outputs) exceeds --max-error {max_error:g}; try --quant fp16 or fp32"
            )
    else:
        stage(5, "no quantization error to measure (fp32)")
    q.consts.update(carried)  # weight-section entries no node reads
    manifest = make_manifest(q, plan, extra)
    stage(6, f"write {out}")
    size = write_bundle(out, manifest, q.consts)
    wbytes = sum(v.nbytes for v in q.consts.values())
    log(
        f"      {size / 1e6:.2f} MB bundle ({wbytes / 1e6:.2f} MB weights), "
        f"done in {time.perf_counter() - t0:.1f}s"
    )
    return BuildResult(Path(out), manifest, plan, size, wbytes, error)
