"""Device-side commands: run, info, bench. No packager imports here."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import numpy as np

from .bundle import BundleError
from .cli_io import emit_outputs, load_inputs, open_session, pubkey
from .device import DEVICES, GPU_WEIGHTS, DeviceError
from .executor import RunError, seeded_feeds


def cmd_run(a: argparse.Namespace) -> int:
    s = open_session(a)
    emit_outputs(s.run(load_inputs(a.input, s.inputs)), a.output)
    return 0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def describe(bundle, file_size: int) -> str:
    m = bundle.manifest
    g = m["graph"]
    out = []
    model = m.get("model", {})
    out.append(
        f"model:    {model.get('name', '?')} (opset {model.get('opset', '?')}, "
        f"source sha256 {model.get('source_sha256', '?')[:16]}...)"
    )
    b = m.get("build", {})
    out.append(
        f"built by: edgepack {b.get('edgepack', '?')}, python {b.get('python', '?')}, "
        f"numpy {b.get('numpy', '?')}, onnx {b.get('onnx', '?')}"
    )
    for kind in ("inputs", "outputs"):
        for t in g[kind]:
            out.append(
                f"{kind[:-1]:<9} {t['name']}: {t['dtype']}[{'x'.join(map(str, t['shape']))}]"
            )
    ops = Counter(n["op"] for n in g["nodes"])
    out.append(
        f"ops:      {len(g['nodes'])} ({', '.join(f'{k} {v}' for k, v in ops.most_common())})"
    )
    from ..kernels.wtypes import WTYPES

    def count(name: str, w: np.ndarray) -> int:  # packed int4 bytes hold two weights each
        row = WTYPES.get(m["weights"][name]["dtype"])
        return int(np.prod(w.shape)) * (row.per_element if row else 1)

    from .text import TOKENIZER  # carried in the weight section, not a parameter

    params = sum(count(k, w) for k, w in bundle.weights.items() if k != TOKENIZER)
    wtypes_used = Counter(
        m["weights"][n["inputs"][1]]["dtype"]
        for n in g["nodes"]
        if n["op"] in ("conv", "dwconv", "linear") and n["inputs"][1] in m["weights"]
    )
    wbytes = sum(w.nbytes for w in bundle.weights.values())
    backends = Counter(n["kernel"]["backend"] for n in g["nodes"])
    out.append(f"kernels:  {', '.join(f'{k} {v}' for k, v in backends.items())}")
    out.append(f"params:   {params:,} in {len(bundle.weights)} tensors ({_fmt_bytes(wbytes)})")
    if wtypes_used:
        out.append(f"weights:  {', '.join(f'{k} {v}' for k, v in sorted(wtypes_used.items()))}")
    out.append(f"bundle:   {_fmt_bytes(file_size)} (format v{m['format_version']})")
    out.append(f"arena:    {_fmt_bytes(m['plan']['arena_bytes'])} planned at pack time")
    q = m.get("quantization", {})
    out.append(
        f"quant:    {q.get('mode', 'fp32')}" + (f" ({q['scheme']})" if "scheme" in q else "")
    )
    xq = Counter(n["attrs"]["xq"] for n in g["nodes"] if n["attrs"].get("xq"))
    for block, count_xq in sorted(xq.items()):
        out.append(
            f"          activations int8 in blocks of {block} at {count_xq} linear(s) "
            "(integer products); float32 elsewhere"
        )
    if "text_encoder" in m:
        e = m["text_encoder"]
        out.append(
            f"encoder:  {e['pooling']} pooling of {e['output']} -> {e['dimensions']} dims"
            f"{', normalised' if e['normalize'] else ''}; texts of up to {e['max_tokens']} "
            f"tokens (tokenizer.json, vocab {e['vocab_size']}): serve answers /v1/embeddings"
        )
    if "llm" in m:
        from .llm_cli import llm_summary

        out.extend(llm_summary(m))
    if "error" in q:
        from .errortable import format_error_table

        out.append(f"quantization error vs fp32 ({q['error'].get('calibration', '')}):")
        out.append(format_error_table(q["error"], limit=8 if "llm" in m else None))
    return "\n".join(out)


def cmd_info(a: argparse.Namespace) -> int:
    from .session import open_located

    bundle = open_located(a.bundle, pubkey(a), getattr(a, "verify_weights", True))
    print(describe(bundle, bundle.header.bundle_size))
    return 0


def _int_at_least(lo: int):
    def parse(v: str) -> int:
        n = int(v)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return n

    return parse


positive_int = _int_at_least(1)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def cmd_bench(a: argparse.Namespace) -> int:
    from .session import open_located

    bundle = open_located(a.bundle, pubkey(a), getattr(a, "verify_weights", True))
    if "llm" in bundle.manifest:
        from .llm import LLMSession
        from .llm_bench import bench_llm, format_bench, profile_llm

        if a.rounds or a.input:
            print("error: --rounds and --input time tensor bundles; a language model's "
                  "bench runs llama-bench's tests (--pp, --tg, --depth)", file=sys.stderr)
            return 2
        s = LLMSession(bundle, threads=a.threads)
        if a.profile:
            print(profile_llm(s, a.depth[0], a.r * 5))
            return 0
        from .threads import set_threads

        threads = a.threads or set_threads(None)
        m = bundle.manifest
        print(
            f"{getattr(a.bundle, 'path', a.bundle)}: {m['llm']['spec']['arch']}, "
            f"{m.get('quantization', {}).get('mode', 'fp32')}, {a.r} repeat(s), "
            f"{threads if threads is not None else 'default'} thread(s)"
        )
        print(format_bench(bench_llm(s, a.pp, a.tg, a.depth, a.r)))
        return 0
    s = open_session(a)
    feeds = load_inputs(a.input, s.inputs) if a.input else seeded_feeds(s.inputs)
    ex = s.executor
    if a.rounds:
        return bench_rounds(ex, feeds, sys.stdin, sys.stdout)
    if a.profile:
        from .profile import format_profile, profile

        print(format_profile(profile(ex, feeds, a.n)))
        return 0
    _timed_runs(ex, feeds, a.warmup)
    times = _timed_runs(ex, feeds, a.n)
    from .threads import set_threads

    threads = a.threads or set_threads(None)
    print(
        f"{getattr(a.bundle, 'path', a.bundle)}: {a.n} runs after {a.warmup} warm-up, "
        f"{threads if threads is not None else 'default'} thread(s), "
        f"device {s.device} ({ex.device.describe()})"
    )
    print(
        f"median {percentile(times, 50):.3f} ms  p99 {percentile(times, 99):.3f} ms  "
        f"min {min(times):.3f} ms  mean {np.mean(times):.3f} ms"
    )
    return 0


def _timed_runs(ex, feeds: dict[str, np.ndarray], n: int) -> list[float]:
    """``n`` inferences into the arena (no output copies), each one's milliseconds."""
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        ex.run_views(feeds)
        times.append((time.perf_counter_ns() - t) / 1e6)
    return times


def bench_rounds(ex, feeds: dict[str, np.ndarray], requests, replies) -> int:
    """Timed runs on request, so a driver can interleave this process with other
    engines in rounds (scripts/bench_cnn.py times the shipped executable this way beside
    ONNX Runtime). Each request line is ``run K`` (answered ``{"ms": [K times]}``) or
    ``output PATH`` (the outputs of one run saved to PATH as .npz, answered
    ``{"ok": true}``); one JSON line answers each; end of input ends."""
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            reply = {"ms": _timed_runs(ex, feeds, int(arg))}
        elif cmd == "output":
            np.savez(arg, **ex.run(feeds))
            reply = {"ok": True}
        else:
            reply = {"error": f"unknown request {line.strip()!r}: run K, or output PATH"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def add_runtime_commands(sub: argparse._SubParsersAction, implicit=None) -> None:
    """The device commands. ``implicit``: the bundle of this executable (no BUNDLE
    argument then), else each command takes a bundle path."""

    def common(
        p: argparse.ArgumentParser, threads: bool = True, device_flag: str = "--device"
    ) -> None:
        if implicit is None:
            p.add_argument("bundle", help="the .epk bundle (or an edgepack executable)")
        else:
            p.set_defaults(bundle=implicit)
        if threads:
            p.add_argument(
                "-t", "--threads", type=positive_int, default=None, help="threads for the kernels"
            )
            p.add_argument(
                device_flag,
                dest="compute_device",
                choices=DEVICES,
                default=None,
                help="run on the host CPU or the GPU (default: as the bundle was "
                "planned; a cuda bundle without a GPU falls back to cpu)",
            )
            p.add_argument(
                "--require-gpu",
                action="store_true",
                help="fail instead of falling back to the CPU when no GPU is usable",
            )
            p.add_argument(
                "--gpu-weights",
                choices=GPU_WEIGHTS,
                default="upload",
                help="upload: copy weights to the GPU once (default); map: let the "
                "GPU read the mapped file (unified-memory boards, docs/cuda.md)",
            )
        p.add_argument(
            "--require-signature",
            metavar="PUBKEY",
            help="refuse the bundle unless signed by this key (edgepack keygen)",
        )

    p = sub.add_parser(
        "run",
        help="run the model on inputs from .npy/.npz",
        description="Run the model once on the given inputs.",
    )
    common(p)
    p.add_argument(
        "--input",
        "-i",
        required=True,
        help=".npz keyed by input name, or .npy for a single-input model",
    )
    p.add_argument("--output", "-o", help="write outputs to this .npz (keyed by output name)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "info",
        help="describe the bundle",
        description="Describe a bundle: "
        "inputs/outputs, ops, parameters, sizes, arena, quantization error.",
    )
    common(p, threads=False)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "bench",
        help="time the model",
        description="Time repeated runs on seeded random inputs (median and P99).",
    )
    common(p)
    p.add_argument("-n", type=positive_int, default=100, help="timed runs (default 100)")
    p.add_argument(
        "--warmup", type=_int_at_least(0), default=10, help="untimed runs first (default 10)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time every op (fused group) instead; slowest first, with shares",
    )
    p.add_argument(
        "--input",
        "-i",
        help="time these inputs (.npz keyed by input name, or .npy) instead of seeded "
        "random ones",
    )
    p.add_argument(
        "--rounds",
        action="store_true",
        help="time on request: read 'run K' or 'output PATH' lines from stdin, answer "
        "each with a JSON line (for benchmark drivers that interleave engines)",
    )
    llm = p.add_argument_group("language-model bundles (llama-bench's tests)")
    llm.add_argument("--pp", type=_int_at_least(0), default=512,
                     help="prompt tokens of the pp test (default 512; 0: none)")
    llm.add_argument("--tg", type=_int_at_least(0), default=128,
                     help="decode steps of the tg tests (default 128; 0: none)")
    llm.add_argument("--depth", type=_int_at_least(0), nargs="+", default=[0, 512, 2048],
                     help="context before the tg tests (default 0 512 2048; those past "
                     "the bundle's --ctx are skipped; --profile: the first)")
    llm.add_argument("-r", type=positive_int, default=3, help="repeats (default 3)")
    p.set_defaults(func=cmd_bench)

    from .llm_cli import add_generate_arguments, cmd_generate

    p = sub.add_parser(
        "generate",
        help="generate text with a language-model bundle",
        description="Stream a continuation of the prompt (or, with --chat, the model's "
        "answer); prompt and decode speeds go to stderr.",
    )
    common(p)
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)

    from .serve.cli import add_serve_arguments, cmd_serve  # argparse only; paho loads on use

    p = sub.add_parser(
        "serve",
        help="take inference jobs from an MQTT broker",
        description="Serve the model to an MQTT fleet (docs/protocol.md).",
    )
    common(p, device_flag="--compute-device")  # serve's --device is its fleet id
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


ERRORS = (BundleError, RunError, DeviceError, FileNotFoundError, ValueError)


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None, errors=ERRORS) -> int:
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    try:
        return a.func(a)
    except errors as e:
        print(f"edgepack: error: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgepack", description="edgepack device runtime")
    add_runtime_commands(parser.add_subparsers(dest="command"))
    return dispatch(parser, argv)
