"""The ``edgepack`` command: ``build`` (packager) plus the device commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .kernels.wtypes import DEFAULT_GROUP, GROUP_SIZES, QUANT_MODES
from .packager.llm import ACT_QUANT, DEFAULT_CHUNK, DEFAULT_CTX, KV_DTYPES
from .packager.quantize import DEFAULT_MIN_WEIGHTS
from .packager.text_encoder import POOLINGS
from .runtime.cli import ERRORS, add_runtime_commands, dispatch


def cmd_build(a: argparse.Namespace) -> int:
    # The packager (and onnx) is imported only for this command.
    from .packager.onnx_import import parse_constant_inputs, parse_shape_overrides
    from .runtime.payload import read_key

    kw = dict(
        input_shapes=parse_shape_overrides(a.input_shape),
        constant_inputs=parse_constant_inputs(a.const_input),
        calib=a.calib,
        max_error=a.max_error,
        min_cosine=a.min_cosine,
        min_weights=a.quant_min_weights,
        group_size=a.group_size,
        conv_algo=a.conv_algo,
        layout=a.layout,
        tokenizer=a.tokenizer,
        pooling=a.pooling,
        embedding_output=a.embedding_output,
        act_quant=a.act_quant,
    )
    private = read_key(a.sign, "private key") if a.sign else None
    embed = read_key(a.embed_pubkey) if a.embed_pubkey else None
    from pathlib import Path

    if Path(a.model).is_dir() or a.model.endswith(".gguf"):  # a language model
        return _build_llm(a, private, embed)
    if a.target:
        from .packager.target_build import build_for_target
        from .targets import load_target

        build_for_target(a.model, load_target(a.target), a.output, a.quant, a.stub, private,
                         embed, **kw)
        return 0
    if not a.output:
        raise ValueError("-o/--output is required without --target")
    if a.stub or embed:
        raise ValueError("--stub and --embed-pubkey need --target (they make an executable)")
    from .packager.build import build

    result = build(a.model, a.output, quant=a.quant or "fp32", **kw)
    if private:
        from .packager.executable import append_trailer

        append_trailer(result.path, 0, result.bundle_bytes, private, None)
        print(f"      signed {result.path}")
    return 0


def _build_llm(a: argparse.Namespace, private: bytes | None, embed: bytes | None) -> int:
    from .packager.llm.build import build_llm

    if a.tokenizer or a.embedding_output or a.pooling != "auto":
        raise ValueError("--tokenizer, --pooling and --embedding-output are for ONNX text "
                         "encoders; a language model carries its folder's tokenizer.json")
    kw = dict(quant_embed=a.quant_embed, group_size=a.group_size, ctx=a.ctx, slots=a.slots,
              chunk=a.chunk, kv=a.kv, act_quant=a.act_quant, max_error=a.max_error)  # fmt: skip
    if a.target:  # the target's stub runs the bundle (run, info, bench; generate needs
        from .packager.target_build import build_for_target  # tokenizers in the stub)
        from .targets import load_target

        target = load_target(a.target)
        build_for_target(a.model, target, a.output, a.quant, a.stub, private, embed,
                         builder=build_llm, cpu_features=target.llvm_feature_names, **kw)
        return 0
    if a.stub or a.embed_pubkey:
        raise ValueError("--stub and --embed-pubkey need --target (they make an executable)")
    if not a.output:
        raise ValueError("-o/--output is required")
    result = build_llm(a.model, a.output, quant=a.quant, **kw)
    if private:
        from .packager.executable import append_trailer

        append_trailer(result.path, 0, result.bundle_bytes, private, None)
        print(f"      signed {result.path}")
    return 0


def cmd_keygen(a: argparse.Namespace) -> int:
    from .packager.signing import keygen

    priv, pub = keygen(a.output)
    print(f"wrote {priv} (private: keep it off devices) and {pub} (public)")
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:
    from .packager.aot import ensure_kernel_builds, host_arch, host_target
    from .targets import load_target

    target = load_target(a.target) if a.target else host_target()
    cross = target.arch != host_arch()
    print(f"kernel builds of target {target.name} for "
          + (f"its executables (cross-compiled for {target.arch})" if cross
             else "the development install and its executables"))  # fmt: skip
    for b, module, folder in ensure_kernel_builds(target):
        print(f"  {b.cpu:12s} {module:20s} {folder}")
    if cross:
        return 0
    import os

    from .kernels.cpu.native import _aot_build  # what a process starting now would take

    try:
        cpu = _aot_build()[1]
    except ImportError as e:
        print(f"runs the JIT kernels: {e}")
        return 0
    forced = os.environ.get("EDGEPACK_KERNELS") == "jit"
    print(f"runs the aot kernels built for {cpu}" + (" (but EDGEPACK_KERNELS=jit is set "
          "here)" if forced else ""))  # fmt: skip
    return 0


def cmd_stub(a: argparse.Namespace) -> int:
    from .packager.stub import build_stub
    from .targets import load_target

    build_stub(load_target(a.target), a.out)
    return 0


def cmd_targets(a: argparse.Namespace) -> int:
    import json

    from .targets import list_targets, load_target

    targets = [load_target(t) for t in a.target] if a.target else list_targets()
    if a.json:
        print(json.dumps([t.as_dict() for t in targets], indent=2))
        return 0
    head = ("name", "arch", "cpu", "glibc", "budget MB", "quant", "threads", "backends", "cuda")
    rows = [head] + [
        (
            t.name,
            t.arch,
            t.cpu,
            t.min_glibc,
            str(t.memory_budget_mb),
            t.default_quant,
            str(t.default_threads),
            ",".join(t.backends),
            t.cuda.arch if t.cuda else "-",
        )
        for t in targets
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgepack",
        description="Pack a trained model into a bundle for an edge device, and run it.",
    )
    parser.add_argument("--version", action="version", version=f"edgepack {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser(
        "build",
        help="pack an ONNX model into a .epk bundle",
        description="Import an ONNX model, fold and fuse, quantize, plan memory and write "
        "a bundle.",
    )
    p.add_argument("model", help="the .onnx model, or a language model: a Hugging Face "
                   "folder or a .gguf file")
    p.add_argument("-o", "--output", help="the bundle (.epk) or, with --target, the "
                   "executable to write (default with --target: dist/<model>-<target>)")
    p.add_argument(
        "--quant",
        choices=QUANT_MODES,
        default=None,
        help="weight storage (default fp32, or the target's default quantization; "
        "docs/quantization.md)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=DEFAULT_GROUP,
        help=f"weights per fp16 scale with --quant int4 (default {DEFAULT_GROUP})",
    )
    p.add_argument("--target", help="make a device executable for this target (name or "
                   ".toml; see `edgepack targets`)")
    p.add_argument("--stub", help="runtime stub to use (default: the stub cache, frozen "
                   "there first when it has none: `edgepack stub`)")
    p.add_argument("--sign", metavar="KEY", help="sign with this private key (edgepack keygen)")
    p.add_argument("--embed-pubkey", metavar="PUBKEY", help="with --target: the executable "
                   "refuses any bundle not signed by this key")
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=1x3x224x224",
        help="fix an input's shape (repeat for several inputs)",
    )
    p.add_argument(
        "--const-input",
        action="append",
        metavar="NAME=FILE.npy|1,2,3",
        help="fix an input's values at pack time: it becomes a constant and the bundle "
        "no longer takes it (e.g. a Resize's scales or a Slice's starts given as inputs)",
    )
    p.add_argument(
        "--calib",
        help="calibration inputs (.npz keyed by input name, arrays "
        "[samples, *shape]); default: 8 seeded random inputs",
    )
    p.add_argument(
        "--min-cosine",
        type=float,
        metavar="C",
        help="with a quantized --quant: keep the layers whose quantization costs the "
        "outputs most in fp32 until the outputs' cosine with fp32 on the calibration "
        "inputs reaches C (default 0.99 with --calib, off without; 0: off)",
    )
    p.add_argument(
        "--max-error",
        type=float,
        metavar="X",
        help="fail if the quantized outputs' relative L2 error exceeds X (a language "
        "model: the mean KL divergence from fp32 over the shipped text)",
    )
    p.add_argument(
        "--quant-min-weights",
        type=int,
        default=DEFAULT_MIN_WEIGHTS,
        metavar="N",
        help="layers with fewer weights stay fp32 (default "
        f"{DEFAULT_MIN_WEIGHTS}; 0 quantizes all)",
    )
    p.add_argument(
        "--conv-algo",
        choices=("auto", "direct"),
        default="auto",
        help="auto (default): 3x3 stride-1 convs run as Winograd on CPU targets when it "
        "pays (docs/bundle-format.md); direct: every conv as im2col + GEMM",
    )
    p.add_argument(
        "--layout",
        choices=("auto", "nchw"),
        default="auto",
        help="auto (default): conv regions run channels-last (NHWC) on CPU targets "
        "(docs/bundle-format.md); nchw: every activation channels-first as imported",
    )
    p.add_argument("--act-quant", choices=ACT_QUANT, default="auto",
                   help="int8 activations: with --quant int8, convs quantize their inputs "
                   "to u8 (per tensor, ranges from --calib) and multiply int8 by int8; a "
                   "language model's int4 and int8 linears quantize theirs in blocks of "
                   "32 (as llama.cpp's Q4_0 and Q8_0; int8 ones on cpu targets where N is "
                   "a multiple of 16 and K of 32); none: float32 activations; auto "
                   "(default): int8 for those linears where the target's CPU has an "
                   "integer dot instruction, float32 for convs")
    enc = p.add_argument_group("text encoders (ONNX; serve answers /v1/embeddings, docs/http.md)")
    enc.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                     help="carry this Hugging Face tokenizer.json: inputs named input_ids, "
                     "attention_mask (and token_type_ids) take tokenized text")
    enc.add_argument("--pooling", choices=POOLINGS, default="auto",
                     help="token vectors -> one vector per text (default auto: none for a "
                     "[batch, dim] output, mean over the mask for [batch, tokens, dim])")
    enc.add_argument("--embedding-output", metavar="NAME",
                     help="the output holding the embeddings (default: a [batch, dim] "
                     "output such as sentence_embedding, else the first [batch, tokens, dim])")
    llm = p.add_argument_group("language models (a model folder)")
    llm.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                     help=f"positions per sequence: the KV cache's length (default {DEFAULT_CTX})")
    llm.add_argument("--slots", type=int, default=1, help="sequences at once (default 1)")
    llm.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                     help=f"prompt tokens per prefill run (default {DEFAULT_CHUNK})")
    llm.add_argument("--quant-embed", choices=QUANT_MODES, default=None,
                     help="the embedding table and output projection (default: --quant; "
                     "a type the embedding lookup lacks keeps them wider)")
    llm.add_argument("--kv", choices=KV_DTYPES, default="f16",
                     help="KV cache element type (default f16)")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser(
        "targets",
        help="list the device targets",
        description="List the shipped device targets (see docs/targets.md), or the given ones.",
    )
    p.add_argument("target", nargs="*", help="a target name or a .toml file (default: all shipped)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_targets)
    p = sub.add_parser(
        "kernels",
        help="compile the CPU kernels ahead of time for this install",
        description="Compile the CPU kernels ahead of time (about 5 minutes a build, two "
        "at a time) into the kernel cache, so that the first run of a bundle starts at "
        "once instead of compiling with numba's JIT; stub builds take the same builds. "
        "pip install runs this (setup.py); run it again after editing kernels/. See "
        "docs/cpu-kernels.md.",
    )
    p.add_argument("--target", help="whose kernel builds (default: the shipped target "
                   "of this machine's architecture that its CPU runs best)")
    p.set_defaults(func=cmd_kernels)
    p = sub.add_parser(
        "stub",
        help="freeze the device runtime for a target (what executables are made from)",
        description="Freeze the device runtime for a target into its runtime stub "
        "(PyInstaller, the `stub` extra; the kernels from `edgepack kernels`' cache). "
        "`edgepack build --target` appends bundles to it, and makes one itself when the "
        "cache has none; this command makes one ahead of time or into --out. For an "
        "aarch64 target on x86_64 the runtime is assembled from Debian's arm64 python3.11 "
        "and aarch64 wheels, its kernels cross-compiled (after `bash "
        "scripts/aarch64_sysroot.sh` once). See docs/executable.md.",
    )
    p.add_argument("--target", required=True, help="target name or .toml file")
    p.add_argument("--out", type=Path, help="where to write the stub (default: the stub cache, "
                   "~/.cache/edgepack/stubs/ or $EDGEPACK_STUB_CACHE)")
    p.set_defaults(func=cmd_stub)
    p = sub.add_parser("keygen", help="make an ed25519 key pair for signing bundles",
                       description="Write STEM.key (private) and STEM.pub (public).")
    p.add_argument("-o", "--output", required=True, metavar="STEM")
    p.set_defaults(func=cmd_keygen)
    add_runtime_commands(sub)
    from .client import add_submit_arguments, cmd_submit  # no paho until a job is sent

    p = sub.add_parser("submit", help="send a job to MQTT agents and wait for the answer",
                       description="Send one inference job to a device or a fleet over MQTT "
                       "(docs/protocol.md) and print or save the answer.")
    add_submit_arguments(p)
    p.set_defaults(func=cmd_submit)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .packager.ir import PackError
    from .targets import TargetError

    return dispatch(make_parser(), argv, ERRORS + (PackError, TargetError, FileExistsError))


if __name__ == "__main__":
    sys.exit(main())
