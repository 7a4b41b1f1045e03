"""What a CNN's convs could take at best on this CPU: the core's multiply-add peak.

A latency goal such as "0.8x ONNX Runtime" is only reachable if the work it implies
fits under the hardware's ceiling. This measures the ceiling the way edgepack's kernels
meet it, then sets each model's multiply-adds (convs and linears, as the ONNX graph
states them: direct convolution, no Winograd) beside it:

- float: ``llvm.fma`` on the widest float vector the JIT host has (what gemm_tiles.py's
  micro-kernels issue), 16 independent accumulators so latency never shows;
- int8: the dot instruction family qgemm.py's tiles use on this host (``vpdpbusd``
  with VNNI, the widened ``vpmaddwd`` pairs on AVX2), likewise 16 accumulators.

Each runs on 1 thread, then on 2 threads at once (numba ``nogil`` loops on two Python
threads), in alternating rounds; the figure is the median round. On the 2-vCPU VMs the
host may place the two vCPUs far apart (scripts/vcpu_probe.py); that changes memory
traffic between them, not this register-only loop, so the 2-thread peak is about twice
the 1-thread one whatever the placement.

    python scripts/bench_peak.py                      # writes docs/benchmarks/peak.md
    python scripts/bench_peak.py --models /tmp/bw/resnet18_b1.onnx --out -

The ms columns are each model's MACs at 100% of the measured peak: no kernel reaches it
(loads, stores, epilogues and the non-conv ops all take issue slots). Compare them with
bench_cnn.py's medians (docs/benchmarks/cnn-threads.md) to see how much of the peak an
engine reaches.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

REPO = Path(__file__).resolve().parent.parent
ACCS = 16  # independent accumulators: > latency x pipes for FMA (4 x 2) and dots
UNROLL = 4  # accumulator sweeps per loop trip, so the loop's own compare is noise


def _host_features() -> frozenset[str]:
    from edgepack.kernels.cpu.simd import host_features

    return frozenset(host_features())


def _float_lanes() -> int:
    from edgepack.kernels.cpu.simd import lanes_for

    return lanes_for(_host_features(), platform.machine())[0]


def _dot_shape() -> tuple[str, int, int]:
    """(family, int32 lanes, byte products per instruction) of qgemm's dots here."""
    from edgepack.kernels.cpu.qdot import dot_isa
    from edgepack.kernels.cpu.qgemm import _SHAPES

    isa = dot_isa(_host_features())
    lanes, cpa, _ = _SHAPES[isa]
    return isa, lanes, 4 * cpa


def _splat(builder, scalar, vty):
    v = ir.Constant(vty, ir.Undefined)
    for i in range(vty.count):
        v = builder.insert_element(v, scalar, ir.Constant(ir.IntType(32), i))
    return v


def _accumulate(builder, n, inits, update, add):
    """ACCS independent accumulators (``inits``, in allocas LLVM promotes to
    registers), each replaced by update(builder, acc) UNROLL times per trip for n trips;
    returns lane 0 of their sum (so nothing is dead code)."""
    slots = [cgutils.alloca_once_value(builder, v) for v in inits]
    with cgutils.for_range(builder, n):
        for _ in range(UNROLL):
            for s in slots:
                builder.store(update(builder, builder.load(s)), s)
    total = builder.load(slots[0])
    for s in slots[1:]:
        total = add(total, builder.load(s))
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


def _make_fma(lanes: int):
    vty = ir.VectorType(ir.FloatType(), lanes)

    @intrinsic
    def fma_loop(typingctx, n, seed):
        def codegen(context, builder, sig, args):
            n, seed = args
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vty, [vty, vty, vty]), f"llvm.fma.v{lanes}f32")
            v = _splat(builder, seed, vty)
            mul = ir.Constant(vty, [0.9999] * lanes)  # acc * 0.9999 + v stays bounded
            inits = [builder.fmul(v, ir.Constant(vty, [1.0 + a / 64] * lanes))
                     for a in range(ACCS)]  # fmt: skip
            return _accumulate(builder, n, inits, lambda b, acc: b.call(fn, [acc, mul, v]),
                               builder.fadd)  # fmt: skip

        return types.float32(types.int64, types.float32), codegen

    return fma_loop


def _make_dot(isa: str, lanes: int, nbytes: int):
    from edgepack.kernels.cpu.qgemm import _dot4

    vi = ir.VectorType(ir.IntType(32), lanes)
    vb = ir.VectorType(ir.IntType(8), nbytes)
    # an empty asm the operand goes through, per dot: LLVM may neither hoist the
    # widening (AVX2 family) out of the loop nor share it between dots
    opaque = ir.InlineAsm(ir.FunctionType(vb, [vb]), "", "=x,0", side_effect=True)

    @intrinsic
    def dot_loop(typingctx, n, seed):
        def codegen(context, builder, sig, args):
            n, seed = args
            u = _splat(builder, builder.trunc(seed, ir.IntType(8)), vb)
            w = builder.xor(u, ir.Constant(vb, [0x35] * nbytes))
            inits = [ir.Constant(vi, [a] * lanes) for a in range(ACCS)]
            return _accumulate(
                builder, n, inits,
                lambda b, acc: _dot4(b, isa, acc, b.call(opaque, [u]), w, lanes), builder.add,
            )  # fmt: skip

        return types.int32(types.int64, types.int64), codegen

    return dot_loop


def _kernels():
    lanes = _float_lanes()
    isa, dlanes, nbytes = _dot_shape()
    dot = _make_dot(isa, dlanes, nbytes)

    @njit(nogil=True, cache=False)
    def run_dot(n):
        return dot(n, 3)

    per_trip = {"fp32": ACCS * UNROLL * lanes, "int8": ACCS * UNROLL * nbytes}
    return {"fp32": fma_runner(), "int8": run_dot}, per_trip, f"fp32 x{lanes}", f"int8 {isa}"


def fma_runner():
    """A compiled ``run(n)``: n trips of the float loop, without the GIL (vcpu_probe.py's
    core_share runs it on two threads)."""
    fma = _make_fma(_float_lanes())

    @njit(nogil=True, cache=False)
    def run(n):
        return fma(n, np.float32(0.5))

    run(10)
    return run


def _timed(fn, n: int, threads: int) -> float:
    """Seconds for `threads` concurrent calls of fn(n), start to last finish."""
    if threads == 1:
        t = time.perf_counter()
        fn(n)
        return time.perf_counter() - t
    barrier = threading.Barrier(threads + 1)
    done: list[float] = []

    def work():
        barrier.wait()
        fn(n)
        done.append(time.perf_counter())

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return max(done) - t0


def measure(rounds: int, seconds: float) -> dict[tuple[str, int], float]:
    """GMAC/s per (dtype, threads), median over alternating rounds."""
    fns, per_trip, _, _ = _kernels()
    trips = {}
    for k, fn in fns.items():
        fn(10)  # compile
        n = 1000
        while _timed(fn, n, 1) < seconds / 4:
            n *= 2
        trips[k] = n
    got: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            for threads in (1, 2):
                s = _timed(fn, trips[k], threads)
                got.setdefault((k, threads), []).append(threads * trips[k] * per_trip[k] / s / 1e9)
    return {key: statistics.median(v) for key, v in got.items()}


def model_macs(path: Path) -> int:
    """Multiply-adds of a model's Conv, Gemm and MatMul nodes, direct convolution."""
    import onnx
    from onnx import shape_inference

    m = shape_inference.infer_shapes(onnx.load(str(path)))
    g = m.graph
    shapes = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        shapes[vi.name] = dims
    for t in g.initializer:
        shapes[t.name] = list(t.dims)
    total = 0
    for node in g.node:
        if node.op_type == "Conv":
            out = shapes[node.output[0]]
            w = shapes[node.input[1]]  # [N, C/group, kh, kw]
            total += int(np.prod(out)) * int(np.prod(w[1:]))
        elif node.op_type in ("Gemm", "MatMul"):
            a, out = shapes[node.input[0]], shapes[node.output[0]]
            k = a[-1]
            if node.op_type == "Gemm" and any(
                    at.name == "transA" and at.i for at in node.attribute):
                k = a[0]
            total += int(np.prod(out)) * k
    return total


def _report(peaks, labels, models, out):
    from bench_cnn import machine_info  # the machine lines bench_cnn's reports carry

    info = machine_info()
    cpu, when = info["CPU"], info["date"]
    lines = [
        "# Multiply-add peak of this CPU, and each model's work at that peak",
        "",
        f"Generated by `scripts/bench_peak.py` on {when}; CPU: {cpu}, "
        f"{platform.machine()}, SIMD {info['SIMD']}. Float: {labels[0]} lanes of `llvm.fma`; int8: "
        f"{labels[1]} (qgemm.py's dot family on this host).",
        "",
        "| dtype | 1 thread GMAC/s | 2 threads GMAC/s | 2t / 1t |",
        "|---|---:|---:|---:|",
    ]
    for k in ("fp32", "int8"):
        one, two = peaks[(k, 1)], peaks[(k, 2)]
        lines.append(f"| {k} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    lines += ["", "Each model's convs and linears as multiply-adds (direct convolution), "
              "and the milliseconds they take at 100% of the peak above:", "",
              "| model | GMAC | fp32 1t ms | fp32 2t ms | int8 1t ms | int8 2t ms |",
              "|---|---:|---:|---:|---:|---:|"]
    for path, macs in models:
        cells = [f"{macs / peaks[(k, t)] / 1e6:.2f}" for k in ("fp32", "int8") for t in (1, 2)]
        lines.append(f"| {Path(path).stem} | {macs / 1e9:.3f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if out == "-":
        print(text)
    else:
        Path(out).write_text(text)
        print(text)
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    ap.add_argument("--models", nargs="*", type=Path, default=[],
                    help="ONNX models whose MACs to set beside the peak")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "peak.md"))
    args = ap.parse_args()
    _, _, *labels = _kernels()
    peaks = measure(args.rounds, args.seconds)
    models = [(p, model_macs(p)) for p in args.models]
    _report(peaks, labels, models, args.out)


if __name__ == "__main__":
    main()
