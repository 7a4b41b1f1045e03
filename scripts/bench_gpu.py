"""Benchmark edgepack's cuda backend against its cpu path and other GPU runtimes.

Engines, on the same seeded input, per quant mode of ResNet-18 (fp32, fp16, int8
weights; activations stay fp32, see docs/quantization.md):

    edgepack-cuda-<q>   the bundle planned for cuda, on the GPU (weights uploaded once)
    edgepack-cpu-<q>    the same bundle with --device cpu (the recorded fallbacks)
    ort-cuda            ONNX Runtime's CUDA execution provider, the fp32 model (if importable)
    torch-cuda          PyTorch on the GPU, the ONNX weights loaded into a torchvision-shaped
                        ResNet-18 (if torch with CUDA is importable), eager fp32

Each engine loads once, warms up, then runs ``--runs`` timed runs (outputs copied to the
host each time, so GPU time is complete). Median and P99 in ms go to stdout and to
``--out`` (docs/benchmarks/gpu.md by default).

    python scripts/bench_gpu.py                       # needs a usable GPU
    python scripts/bench_gpu.py --runs 50 --threads 4 --out /tmp/gpu.md

Without a usable GPU it says why and exits with status 0, writing nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

QUANTS = ("fp32", "fp16", "int8")
BACKENDS = ("cuda", "cpu", "ref")


def _time(fn: Callable[[], object], runs: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return float(np.percentile(t, 50)), float(np.percentile(t, 99))


def _ort_cuda(model: Path, x: np.ndarray) -> Callable[[], object] | str:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime not importable"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)"
    sess = ort.InferenceSession(str(model), providers=["CUDAExecutionProvider"])
    if "CUDAExecutionProvider" not in sess.get_providers():
        return "onnxruntime could not start its CUDA provider"
    name = sess.get_inputs()[0].name
    return lambda: sess.run(None, {name: x})


def _torch_cuda(model: Path, x: np.ndarray) -> Callable[[], object] | str:
    try:
        import torch
    except ImportError:
        return "torch not importable"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    try:
        net = _torch_resnet18(model, torch)
    except Exception as e:  # a weight-name mismatch must not end the other rows
        return f"could not load the ONNX weights into torch ({e})"
    xt = torch.from_numpy(x).cuda()

    def run() -> object:
        with torch.inference_mode():
            return net(xt).cpu()

    return run


def _torch_resnet18(model: Path, torch):
    """torchvision's ResNet-18 with the ONNX initializers: make_models names them as
    torchvision's state dict does (conv1.weight, layer1.0.bn1.running_mean, ...)."""
    import onnx
    from onnx import numpy_helper

    tv = __import__("torchvision.models", fromlist=["resnet18"])
    net = tv.resnet18(weights=None)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    sd = net.state_dict()
    missing = [k for k in sd if not k.endswith("num_batches_tracked") and k not in inits]
    if missing:
        raise ValueError(f"no ONNX initializer for {missing[:3]}")
    for k in sd:
        if k in inits:
            sd[k] = torch.from_numpy(np.ascontiguousarray(inits[k]))
    net.load_state_dict(sd)
    return net.eval().cuda()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="cpu kernel threads")
    p.add_argument("--work", type=Path, default=None, help="keep models/bundles here")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "gpu.md")
    a = p.parse_args(argv)

    from edgepack.kernels.cuda.device import probe

    ok, why = probe()
    if not ok:
        print(f"bench_gpu: no usable GPU ({why}); nothing to measure")
        return 0
    if "simulator" in why:
        print(
            "bench_gpu: the numba CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1); "
            "timings would be meaningless - unset it on a GPU machine"
        )
        return 0

    import make_models
    import onnx
    from edgepack.packager.build import build
    from edgepack.runtime.session import Session

    work = a.work or Path(tempfile.mkdtemp(prefix="edgepack-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "resnet18.onnx"
    if not model.exists():
        onnx.save(make_models.resnet18(seed=0), model)
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)

    rows: list[tuple[str, str, str, str]] = []  # engine, median, p99, note
    ref_out = None
    for q in QUANTS:
        # The cpu row is a bundle packed for the host (channels-last, Winograd, chains:
        # what a cpu target gets), not the cuda bundle's channels-first fallback.
        bundles = {"cuda": work / f"resnet18-{q}-cuda.epk", "cpu": work / f"resnet18-{q}-cpu.epk"}
        for device, bundle in bundles.items():
            if not bundle.exists():
                backends = BACKENDS if device == "cuda" else ("cpu", "ref")
                build(model, bundle, quant=q, backends=backends, log=lambda s: None)
        outs = {}
        for device, bundle in bundles.items():
            s = Session(bundle, threads=a.threads, device=device, require_gpu=device == "cuda")
            name = s.inputs[0]["name"]
            feeds = {name: x}
            runs = a.runs if device == "cuda" else max(10, a.runs // 5)
            med, p99 = _time(lambda s=s, f=feeds: s.executor.run_views(f), runs, a.warmup)
            outs[device] = s.run(feeds)[s.outputs[0]["name"]]
            rows.append((f"edgepack-{device}-{q}", f"{med:.2f}", f"{p99:.2f}", f"{runs} runs"))
            print(f"{rows[-1][0]:<22} median {med:8.2f} ms  p99 {p99:8.2f} ms")
        err = float(np.abs(outs["cuda"] - outs["cpu"]).max())
        rows[-2] = rows[-2][:3] + (rows[-2][3] + f", max |cuda - cpu| {err:.2e}",)
        if q == "fp32":
            ref_out = outs["cuda"]
    for label, make in (("ort-cuda", _ort_cuda), ("torch-cuda", _torch_cuda)):
        fn = make(model, x)
        if isinstance(fn, str):
            rows.append((label, "-", "-", fn))
            print(f"{label:<22} skipped: {fn}")
            continue
        med, p99 = _time(fn, a.runs, a.warmup)
        out = fn()
        out = np.asarray(out[0] if isinstance(out, list) else out.numpy())
        note = f"{a.runs} runs, max |x - edgepack-cuda-fp32| {np.abs(out - ref_out).max():.2e}"
        rows.append((label, f"{med:.2f}", f"{p99:.2f}", note))
        print(f"{label:<22} median {med:8.2f} ms  p99 {p99:8.2f} ms")

    dev_name = why
    lines = [
        "# GPU benchmark: ResNet-18, batch 1",
        "",
        f"Measured {dt.date.today().isoformat()} with `python scripts/bench_gpu.py` on "
        f"{dev_name}, host {platform.machine()} ({platform.processor() or 'cpu'}), "
        f"{a.threads or 'default'} cpu thread(s). Times in ms per inference, input upload "
        "and output download included.",
        "",
        "| engine | median ms | P99 ms | notes |",
        "|--------|----------:|-------:|-------|",
        *[f"| {e} | {m} | {p} | {n} |" for e, m, p, n in rows],
        "",
    ]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
