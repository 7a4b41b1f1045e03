"""Cold start of device executables: exec -> first result printed, page cache warm.

Side by side in one run, same machine, same model and input:
  edgepack      dist/<model>-linux-x86_64 (one file; its runtime unpacked once into the
                cache folder, as on every start after the first)
  ort-onedir    ONNX Runtime + the .onnx frozen with PyInstaller --onedir (a folder)
  ort-onefile   the same frozen --onefile (one file; PyInstaller unpacks it every start)
for the digits CNN and ResNet-18 (fp32), plus edgepack start-up with a 1 GiB payload
(first start: full checksum; later starts: the verified record). Writes
docs/benchmarks/coldstart.md.

    python scripts/bench_coldstart.py [--runs 20] [--work /tmp/edgepack-coldstart]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

ORT_RUNNER = '''
import os, sys
import numpy as np
import onnxruntime as ort
here = os.path.dirname(os.path.abspath(__file__))
base = getattr(sys, "_MEIPASS", here)
so = ort.SessionOptions()
so.intra_op_num_threads = 1
s = ort.InferenceSession(os.path.join(base, "model.onnx"), so, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[1])
y = s.run(None, {s.get_inputs()[0].name: x})[0]
print("prediction: class", int(y.reshape(y.shape[0], -1)[0].argmax()))
'''


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def freeze_ort(work: Path, model: Path, mode: str) -> Path:
    name = f"ort-{model.parent.name}-{mode}"
    out = work / "ort" / (name if mode == "onefile" else f"{name}/{name}")
    if out.exists():
        return out
    src = work / "ort" / f"{name}.py"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(ORT_RUNNER)
    sh([sys.executable, "-m", "PyInstaller", f"--{mode}", "--noconfirm", "--log-level", "WARN",
        "--name", name, "--distpath", str(work / "ort"), "--workpath", str(work / "ort-build"),
        "--specpath", str(work / "ort-build"), "--add-data", f"{model}:.",
        "--exclude-module", "matplotlib", "--exclude-module", "scipy",
        "--exclude-module", "torch", str(src)])
    return out


def prepare(work: Path) -> dict:
    import make_models
    import onnx
    import train_digits

    work.mkdir(parents=True, exist_ok=True)
    models = {"digits": REPO / "tests" / "data" / "digits_cnn.onnx"}
    rn = work / "resnet18.onnx"
    if not rn.exists():
        onnx.save(make_models.resnet18(seed=0), rn)
    models["resnet18"] = rn
    _, x_test, _, _ = train_digits.load_split()
    inputs = {"digits": work / "digits.npy", "resnet18": work / "resnet18.npy"}
    np.save(inputs["digits"], x_test[:1])
    np.save(inputs["resnet18"],
            np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32))
    engines = {}
    for name, m in models.items():
        # ORT's runner loads model.onnx: give it that name inside the frozen app
        named = work / f"{name}-model" / "model.onnx"
        named.parent.mkdir(exist_ok=True)
        shutil.copy(m, named)
        exe = work / f"{name}-linux-x86_64"
        if not exe.exists():
            sh([sys.executable, "-m", "edgepack.cli", "build", str(m), "--target",
                "linux-x86_64", "--quant", "fp32", "-o", str(exe)])
        engines[name] = {
            "edgepack": [str(exe), "run", "--threads", "1", "--input", str(inputs[name])],
            "ort-onedir": [str(freeze_ort(work, named, "onedir")), str(inputs[name])],
            "ort-onefile": [str(freeze_ort(work, named, "onefile")), str(inputs[name])],
        }
    return engines


def time_cmd(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, env=env)
    dt = time.perf_counter() - t
    if r.returncode or b"prediction" not in r.stdout and b"params" not in r.stdout:
        raise SystemExit(f"{cmd[0]} failed: {r.stderr.decode()[-2000:]}")
    return dt * 1e3


def big_payload(work: Path) -> Path:
    from edgepack.packager.executable import assemble
    from edgepack.packager.stub import cached_stub
    from edgepack.packager.writer import write_bundle
    from edgepack.targets import load_target
    from test_bundle_format import tiny_manifest  # the hand-written one-op bundle

    exe = work / "big-linux-x86_64"
    if not exe.exists():
        manifest, weights = tiny_manifest()
        weights["big"] = np.ones(256 * 2**20, np.float32)
        manifest["weights"]["big"] = {"shape": [256 * 2**20], "dtype": "f32"}
        write_bundle(work / "big.epk", manifest, weights)
        assemble(cached_stub(load_target("linux-x86_64")), work / "big.epk", exe)
        (work / "big.epk").unlink()
    return exe


def _size(exe: Path, engine: str) -> int:
    """Bytes on disk: the file, or the whole folder of a --onedir build."""
    if engine == "ort-onedir":
        return sum(p.stat().st_size for p in exe.parent.rglob("*") if p.is_file())
    return exe.stat().st_size


def stats(xs: list[float]) -> tuple[float, float]:
    return float(np.median(xs)), float(np.percentile(xs, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgepack-coldstart"))
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "coldstart.md")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    engines = prepare(a.work)
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(a.work / "cache"))
    rows = []
    for model, cmds in engines.items():
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for cmd in cmds.values():  # warm the page cache (and unpack edgepack's runtime once)
            for _ in range(2):
                time_cmd(cmd, env)
        for i in range(a.runs):  # interleaved, rotating order, so noise hits all alike
            order = list(cmds.items())
            order = order[i % len(order):] + order[: i % len(order)]
            for name, cmd in order:
                times[name].append(time_cmd(cmd, env))
        for name, ts in times.items():
            med, p99 = stats(ts)
            rows.append((model, name, med, p99))
            print(f"{model:<9} {name:<12} median {med:7.1f} ms  P99 {p99:7.1f} ms", flush=True)
    big = big_payload(a.work)
    small = engines["digits"]["edgepack"][0]
    first, later_big, later_small = [], [], []
    for _ in range(5):
        vdir = a.work / "cache" / "verified"
        shutil.rmtree(vdir, ignore_errors=True)
        first.append(time_cmd([str(big), "info"], env))
        later_big.append(time_cmd([str(big), "info"], env))
        later_small.append(time_cmd([small, "info"], env))
    sizes = {Path(c[0]).name: _size(Path(c[0]), name) for m in engines.values()
             for name, c in m.items()}
    write_report(a.out, rows, stats(first), stats(later_big), stats(later_small), sizes, a.runs)


def write_report(out: Path, rows, first, later_big, later_small, sizes, runs) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    lines = [
        "# Cold start: device executable vs frozen ONNX Runtime",
        "",
        "Generated by `scripts/bench_coldstart.py`: wall time from exec to the first result "
        f"printed, page cache warm, {runs} interleaved runs each; 1 inference thread.",
        f"Machine: {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}.",
        "",
        "| model | engine | median ms | P99 ms | ratio to edgepack |",
        "|---|---|---:|---:|---:|",
    ]
    base = {m: med for m, e, med, _ in rows if e == "edgepack"}
    for m, e, med, p99 in rows:
        lines.append(f"| {m} | {e} | {med:.0f} | {p99:.0f} | {med / base[m]:.2f} |")
    lines += [
        "",
        "Start-up with a 1 GiB payload (`info`: open, validate, print):",
        "",
        "| case | median ms | P99 ms |",
        "|---|---:|---:|",
        f"| 1 GiB payload, first start (full sha256 of the weights) | {first[0]:.0f} | "
        f"{first[1]:.0f} |",
        f"| 1 GiB payload, later starts (verified record) | {later_big[0]:.0f} | "
        f"{later_big[1]:.0f} |",
        f"| 70 KB payload (digits) | {later_small[0]:.0f} | {later_small[1]:.0f} |",
        "",
        "Sizes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(sizes.items())) + ".",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
