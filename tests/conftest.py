"""Shared fixtures. Every end-to-end path goes through a real bundle file:
pack -> write -> mmap -> run (the serialise-and-reload cycle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# The `cuda` tests run the cuda backend's kernels in numba's CUDA simulator unless told
# otherwise: scripts/gpu_check.sh sets NUMBA_ENABLE_CUDASIM=0 to run them on a real GPU.
# numba reads the variable when first imported, which is after this file.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# The suite runs numba's JIT kernels, as it did before installs compiled them ahead of
# time: the kernel tests compile each one against the reference, and the numba-specific
# paths (serial builds, dispatchers, the instruction families) are what they check. The
# ahead-of-time builds a fresh install runs give the same bits: tests/test_first_run.py
# and the frozen executables check them.
os.environ.setdefault("EDGEPACK_KERNELS", "jit")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
# `python -m pytest` puts the working directory (the repository root) first on the
# path, where the folder `kernels/` (installed as edgepack.kernels) would shadow PyPI's
# `kernels`, which transformers >= 5.25 imports: every transformers reference then
# failed with "cannot import name 'CUDAProperties' from 'kernels'". Nothing here is
# imported by a top-level name from the root, so it comes off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))


def cli_env(extra: dict | None = None) -> dict[str, str]:
    """The environment for an ``edgepack`` command the tests run as a user would: this
    one without the suite's EDGEPACK_KERNELS=jit (so the kernels the install built, or
    JIT where it built none), plus ``extra``. The suite's process keeps JIT (above); a
    command in a fresh process JIT-compiles every kernel it meets again: the LLM
    build/info/generate/bench commands of tests/test_llm_text.py took 140 s that way
    on a cold numba cache against 7 s on the install's kernels."""
    env = {k: v for k, v in os.environ.items() if k != "EDGEPACK_KERNELS"}
    return {**env, **(extra or {})}


def bench_rounds(cmd: list[str], work: Path, env: dict | None = None) -> dict[str, np.ndarray]:
    """Drive ``cmd`` (an ``edgepack bench ... --rounds`` command line) as a benchmark
    driver does (docs/cli.md); checks every answer and returns the saved outputs."""
    out = work / "rounds.npz"
    r = subprocess.run(cmd, input=f"run 3\noutput {out}\nwhat\n", capture_output=True,
                       text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    replies = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(replies) == 4, r.stdout
    assert replies[0] == {"ready": True}
    assert len(replies[1]["ms"]) == 3 and all(t > 0 for t in replies[1]["ms"])
    assert replies[2] == {"ok": True}
    assert "unknown request 'what'" in replies[3]["error"]
    with np.load(out) as saved:
        return {k: saved[k] for k in saved.files}


def pack(model, out: Path, quiet: bool = True, **kw):
    """Build a bundle with the real pipeline and return its path."""
    from edgepack.packager.build import build

    build(model, out, log=(lambda s: None) if quiet else print, **kw)
    return out


def load(path: Path, threads: int | None = 1):
    from edgepack.runtime.session import Session

    return Session(path, threads=threads)


def assert_allocates_nothing(run, runs: int = 100) -> int:
    """Call ``run`` 10 times to let interpreter one-offs (free lists) settle under
    tracing, then ``runs`` times: no Python memory may be retained and the traced peak
    stays under 8 KB; everything numba allocates is freed. Returns numba's allocation
    count over the runs (parallel loops allocate and free their schedule per call)."""
    import tracemalloc

    from numba.core.runtime import _nrt_python, rtsys

    _nrt_python.memsys_enable_stats()
    nrt_before = rtsys.get_allocation_stats()
    tracemalloc.start()
    try:
        for _ in range(10):
            run()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(runs):
            run()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    nrt_after = rtsys.get_allocation_stats()
    assert peak - base < 8 * 1024, f"peak {peak - base} B traced during {runs} runs"
    assert current - base < 1024, f"{current - base} B retained after {runs} runs"
    allocs = nrt_after.alloc - nrt_before.alloc
    assert allocs == nrt_after.free - nrt_before.free, "numba memory retained across runs"
    return allocs


def ort_run(model, feeds: dict[str, np.ndarray], optimize: bool = True) -> list[np.ndarray]:
    """ONNX Runtime on one thread; ``optimize`` False runs the graph as written (no
    fusions: QDQ pairs stay dequantize-then-float-op, as their operator text says)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, (str, Path)) else model.SerializeToString()
    sess = ort.InferenceSession(
        str(src) if isinstance(src, Path) else src, so, providers=["CPUExecutionProvider"]
    )
    return sess.run(None, feeds)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Random-weight ResNet-18 and MobileNetV2, made by scripts/make_models.py."""
    import make_models
    import onnx

    d = tmp_path_factory.mktemp("models")
    onnx.save(make_models.resnet18(seed=0), d / "resnet18.onnx")
    onnx.save(make_models.mobilenet_v2(seed=0), d / "mobilenet_v2.onnx")
    return d


@pytest.fixture(scope="session")
def digit_inputs(tmp_path_factory) -> Path:
    """One held-out digit image as x.npy (scripts/train_digits.py's split), the input
    the executables are run on (tests/test_frozen.py, tests/test_stub_aarch64.py)."""
    import train_digits

    d = tmp_path_factory.mktemp("inputs")
    _, x_test, _, _ = train_digits.load_split()
    np.save(d / "x.npy", x_test[:1])
    return d / "x.npy"


@pytest.fixture(scope="session")
def digits_onnx() -> Path:
    return DATA / "digits_cnn.onnx"
