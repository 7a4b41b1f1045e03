"""Batch-1 linear layers (GEMV) per weight type, edgepack against ONNX Runtime.

A decoder LLM at batch 1 is a chain of matrix-vector products whose time is the
weights' bytes over the memory bandwidth the kernel reaches. Each engine runs the same
y = x @ W.T on the same weights, in rounds that interleave the engines so noise hits
them alike; the figures are the kernel's effective weight bandwidth (stored bytes per
second, scales included) and, per row, the ratio to ONNX Runtime's kernel for the same
storage: ``MatMul`` for fp32, ``MatMulNBits`` (4 bits, block 32, fp32 scales, the
default zero point 8: its Q4_0-like path) for int4. edgepack runs its registry's CPU
``linear`` kernels bound the way the runtime binds them (kernels/registry.py): fp32
BLAS, int8/fp16/bf16 the explicit-SIMD ``gemv`` (weights widened in registers), int4 the
fused ``gemv_q4`` (i4q8: the integer ``gemv_q4_q8``; i4x16: the same products on weights
interleaved by 16 rows, ``gemm_q4x16_q8``, what packed int4 language models run),
fp16/bf16 above 8 rows a decode into scratch then BLAS.

    python scripts/bench_gemv.py                       # writes docs/benchmarks/gemv.md + png
    python scripts/bench_gemv.py --rounds 5 --shapes 576x1536

To compare against numpy's BLAS as it runs outside this sandbox, unset
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in that command only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# (N, K): SmolLM2-135M's projections (576 wide, MLP 1536, vocab 49152) and a 7B-class
# 4096 x 4096 (bigger than any cache)
SHAPES = [(1536, 576), (576, 1536), (49152, 576), (4096, 4096)]
# i4q8: int4 weights with int8 activations (a linear node's xq, kernels/cpu/qdot.py);
# i4x16: the same with the weights interleaved by 16 rows (kernels/cpu/q4x16.py)
EDGEPACK = ("f32", "bf16", "f16", "i8", "i4", "i4q8", "i4x16")
# the ORT kernel each is compared with; ort-int4-q8 is MatMulNBits at accuracy_level 4
# (its int8-activation path, as llama.cpp's Q4_0 x Q8_0)
PEER = {"f32": "ort-fp32", "i4": "ort-int4", "i4q8": "ort-int4-q8", "i4x16": "ort-int4-q8"}


def _edgepack_linear(dtype: str, w: np.ndarray, x: np.ndarray, group: int):
    from edgepack.kernels import layout, wtypes
    from edgepack.kernels.registry import lookup
    from edgepack.runtime.executor import aligned_arena

    xq, rows16 = dtype in ("i4q8", "i4x16"), dtype == "i4x16"
    dtype = "i4" if xq else dtype
    stored, scale = wtypes.QUANTIZE[dtype](w, group)
    if rows16:
        stored, scale = layout.q4_interleave(stored, scale)
    for a in (stored, scale):
        if a is not None:
            a.flags.writeable = False
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    attrs = {"act": "none", "act_args": [0.0, 0.0]}
    if dtype == "i4":
        attrs["wshape"] = list(w.shape)
    if xq:
        attrs["xq"] = 32
    if rows16:
        attrs["interleave"] = layout.Q4_INTERLEAVE
    ins = [x, stored, None, scale]
    specs = [
        (x.shape, "f32"),
        (stored.shape, dtype),
        None,
        None if scale is None else (scale.shape, wtypes.of_array(scale)),
    ]
    k = lookup("linear", dtype, "cpu")
    scratch = aligned_arena(max(1, k.scratch(specs, [y.shape], attrs)))
    step = k.bind(ins, [y], scratch, attrs)
    nbytes = stored.nbytes + (0 if scale is None else scale.nbytes)
    return step, y, nbytes


def _ort_session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _ort_fp32(w: np.ndarray, threads: int):
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["y"])],
        "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return _ort_session(m, threads), w.nbytes


def _ort_int4_q8(w: np.ndarray, threads: int):
    return _ort_int4(w, threads, accuracy_level=4)


def _ort_int4(w: np.ndarray, threads: int, block: int = 32, accuracy_level: int = 0):
    """MatMulNBits with ORT's layout: per row n, blocks of ``block`` weights, two per
    byte (element 2i in the low nibble), q = round(w / s) + 8 with s = max|w| / -8 of
    the block as in wtypes' int4 (same codes, only the byte order differs)."""
    from edgepack.kernels import wtypes
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    assert k % block == 0
    packed, scale = wtypes.QUANTIZE["i4"](w, block)
    codes = wtypes.q4_codes(packed) + 8  # 0..15, weight order
    blob = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    blob = blob.reshape(n, k // block, block // 2)
    scales = scale.astype(np.float32).reshape(-1)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "b", "s"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        **({"accuracy_level": accuracy_level} if accuracy_level else {}),
    )
    g = helper.make_graph(
        [node],
        "gemv4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(blob, "b"), numpy_helper.from_array(scales, "s")],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    return _ort_session(m, threads), blob.nbytes + scales.nbytes


def _runs(step: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure(n: int, k: int, rounds: int, per_round: int, threads: int, group: int) -> dict:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    engines: dict[str, tuple[Callable[[], object], int, Callable[[], np.ndarray]]] = {}
    for dtype in EDGEPACK:
        step, y, nbytes = _edgepack_linear(dtype, w, x, group)
        engines[f"edgepack-{dtype}"] = (step, nbytes, lambda y=y: y.copy())
    for name, make in (("ort-fp32", _ort_fp32), ("ort-int4", _ort_int4),
                       ("ort-int4-q8", _ort_int4_q8)):  # fmt: skip
        sess, nbytes = make(w, threads)
        feed = {"x": x}
        out: list[np.ndarray] = []

        def run(sess=sess, feed=feed, out=out) -> None:
            out[:] = sess.run(None, feed)

        engines[name] = (run, nbytes, lambda out=out: out[0])
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    times: dict[str, list[float]] = {e: [] for e in engines}
    for step, _, _ in engines.values():  # warm-up: compile, first touch
        step()
        step()
    for _ in range(rounds):
        for name, (step, _, _) in engines.items():
            times[name] += _runs(step, per_round)
    rows = {}
    for name, (step, nbytes, result) in engines.items():
        step()
        got = result().reshape(ref.shape)
        med = float(np.median(times[name]))
        p99 = float(np.percentile(times[name], 99))
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        rows[name] = {
            "median_ms": med * 1e3,
            "p99_ms": p99 * 1e3,
            "bytes": nbytes,
            "gbs": nbytes / med / 1e9,
            "rel_l2": rel,
        }
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba
    import onnxruntime

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx512f", "avx512_vnni", "avx2", "fma") if f" {f}" in flags]
    return (
        f"{cpu} ({', '.join(isa)}), numba {numba.__version__}, "
        f"onnxruntime {onnxruntime.__version__}, numpy {np.__version__}"
    )


def write_report(results: dict, args, out: Path) -> None:
    lines = [
        "# GEMV (batch-1 linear) per weight type",
        "",
        f"`python scripts/bench_gemv.py` on {dt.date.today()}, {machine()}; "
        f"{args.threads} thread(s), {args.rounds} interleaved rounds of {args.per_round} runs. "
        "GB/s = stored weight bytes (scales included) / median time. Ratio = edgepack "
        "median / ONNX Runtime median for the same storage (ORT `MatMul` for fp32, "
        "`MatMulNBits` 4-bit block 32 for int4); below 1 is faster. rel L2 against a "
        "float64 product with the float32 weights (so it includes the storage's own error).",
        "",
        "| N x K | engine | median ms | P99 ms | GB/s | ratio vs ORT | rel L2 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, rows in results.items():
        for name, r in rows.items():
            peer = PEER.get(name.removeprefix("edgepack-")) if name.startswith("edgepack") else None
            ratio = f"{r['median_ms'] / rows[peer]['median_ms']:.2f}" if peer else ""
            lines.append(
                f"| {shape} | {name} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | "
                f"{r['gbs']:.1f} | {ratio} | {r['rel_l2']:.1e} |"
            )
    out.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(results)
    names = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(
            [j + i * width for j in range(len(shapes))],
            [results[s][name]["gbs"] for s in shapes],
            width,
            label=name,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("weight GB/s (median)")
    ax.set_title(f"batch-1 linear, {args.threads} thread(s)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--group", type=int, default=32, help="edgepack int4 group size")
    ap.add_argument("--shapes", nargs="*", help="NxK (default: SmolLM2-135M's and 4096x4096)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "gemv.md")
    args = ap.parse_args()
    from edgepack.runtime.threads import set_threads

    set_threads(args.threads)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    results = {}
    for n, k in shapes:
        rows = measure(n, k, args.rounds, args.per_round, args.threads, args.group)
        results[f"{n}x{k}"] = rows
        for name, r in rows.items():
            print(
                f"{n}x{k:<6} {name:<15} {r['median_ms']:8.3f} ms  p99 {r['p99_ms']:8.3f}  "
                f"{r['gbs']:6.1f} GB/s  rel {r['rel_l2']:.1e}",
                flush=True,
            )
    write_report(results, args, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
