"""The CUDA path end to end: pack -> write -> mmap -> run on the cuda backend, device
selection and fallback, the packager's plan for cuda targets, unified-memory budgets,
and what a cuda stub carries.

Without a GPU the cuda tests run in numba's CUDA simulator (conftest.py turns it on);
scripts/gpu_check.sh runs the same file on a real GPU with the simulator off.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli_env, ort_run, pack

# One worker for the module: its bundles fixture (packing and the simulator's first
# compiles) took 76 s and 70 s in each of the two CI workers that ran its tests.
pytestmark = pytest.mark.xdist_group("cuda")
CUDA_BACKENDS = ("cuda", "cpu", "ref")
BOTH = ("cuda", "cpu")


@pytest.fixture(scope="module")
def cuda_bundles(tmp_path_factory, digits_onnx) -> dict[str, Path]:
    """The digits CNN planned for a cuda target, fp32 and int8."""
    d = tmp_path_factory.mktemp("cuda")
    return {
        q: pack(digits_onnx, d / f"digits-{q}.epk", quant=q, backends=CUDA_BACKENDS)
        for q in ("fp32", "int8")
    }


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory, digits_onnx) -> Path:
    return pack(digits_onnx, tmp_path_factory.mktemp("cpu") / "digits.epk")


def _feeds(session, n: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    i = session.inputs[0]
    return {i["name"]: rng.standard_normal(i["shape"]).astype(np.float32)}


def _session(path: Path, **kw):
    from edgepack.runtime.session import Session

    return Session(path, threads=1, **kw)


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.cuda
def test_digits_fp32_on_cuda_matches_ort_and_cpu(cuda_bundles, digits_onnx):
    s = _session(cuda_bundles["fp32"])
    assert s.device == "cuda"
    nodes = s.manifest["graph"]["nodes"]
    assert {n["kernel"]["backend"] for n in nodes} == {"cuda"}
    assert all(n["kernel"]["fallback"]["backend"] == "cpu" for n in nodes)
    feeds = _feeds(s)
    got = s.run(feeds)
    name = s.outputs[0]["name"]
    (want,) = ort_run(digits_onnx, feeds)
    np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4)
    cpu = _session(cuda_bundles["fp32"], device="cpu")
    assert cpu.device == "cpu"
    np.testing.assert_allclose(got[name], cpu.run(feeds)[name], rtol=1e-5, atol=1e-5)
    # run twice: nothing may depend on what the arena held before
    np.testing.assert_array_equal(s.run(feeds)[name], got[name])


@pytest.mark.cuda
def test_digits_int8_on_cuda_matches_cpu_fallback(cuda_bundles):
    s = _session(cuda_bundles["int8"])
    assert s.device == "cuda"
    assert {n["kernel"]["dtype"] for n in s.manifest["graph"]["nodes"]} >= {"i8"}
    feeds = _feeds(s)
    name = s.outputs[0]["name"]
    cpu = _session(cuda_bundles["int8"], device="cpu").run(feeds)[name]
    np.testing.assert_allclose(s.run(feeds)[name], cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_traced_run_on_cuda_gives_host_arrays(cuda_bundles):
    s = _session(cuda_bundles["fp32"])
    trace = s.executor.run_traced(_feeds(s))
    assert all(isinstance(v, np.ndarray) for v in trace.values())
    cpu = _session(cuda_bundles["fp32"], device="cpu").executor.run_traced(_feeds(s))
    for k, v in cpu.items():
        np.testing.assert_allclose(trace[k], v, rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.cuda
def test_gpu_weights_map_gives_the_same_result(cuda_bundles):
    feeds = None
    outs = []
    for mode in ("upload", "map"):
        s = _session(cuda_bundles["int8"], gpu_weights=mode)
        feeds = feeds or _feeds(s)
        outs.append(s.run(feeds)[s.outputs[0]["name"]])
    np.testing.assert_array_equal(outs[0], outs[1])


# --- selection and fallback --------------------------------------------------------------


@pytest.mark.cuda
def test_no_gpu_falls_back_to_cpu_with_one_warning(cuda_bundles, monkeypatch, caplog):
    monkeypatch.setenv("EDGEPACK_NO_GPU", "1")
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        s = _session(cuda_bundles["int8"])
        s.run(_feeds(s))
        s.run(_feeds(s))
    assert s.device == "cpu"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "no usable GPU" in warnings[0].getMessage()
    assert "EDGEPACK_NO_GPU" in warnings[0].getMessage()


@pytest.mark.cuda
def test_require_gpu_refuses_without_one(cuda_bundles, cpu_bundle, monkeypatch):
    from edgepack.runtime.device import DeviceError

    monkeypatch.setenv("EDGEPACK_NO_GPU", "1")
    with pytest.raises(DeviceError, match=r"GPU is required \(--require-gpu\)"):
        _session(cuda_bundles["fp32"], require_gpu=True)
    # a host-planned bundle is refused before any GPU is looked for
    with pytest.raises(DeviceError, match=r"--require-gpu: this bundle was planned for the host"):
        _session(cpu_bundle, require_gpu=True)
    with pytest.raises(ValueError, match="contradicts"):
        _session(cpu_bundle, device="cpu", require_gpu=True)


@pytest.mark.cuda
def test_device_cpu_on_a_cuda_bundle_does_not_warn(cuda_bundles, caplog):
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        s = _session(cuda_bundles["fp32"], device="cpu")
    assert s.device == "cpu" and not caplog.records
    names = {k.name for _, k in _bound_kernels(s)}
    assert all(n.startswith("cpu.") for n in names), names


@pytest.mark.cuda
def test_device_cuda_refuses_a_cpu_bundle(cpu_bundle):
    # A host plan's graph is laid out for the cpu kernels (channels-last, panels,
    # Winograd, fused chains) and records no cuda kernel: no backend adapts to another's
    # plan, so the GPU is refused up front, with what to do instead.
    from edgepack.runtime.device import DeviceError

    nodes = _session(cpu_bundle).manifest["graph"]["nodes"]
    assert {n["kernel"]["backend"] for n in nodes} <= {"cpu", "ref"}
    assert not any("fallback" in n["kernel"] for n in nodes)
    why = r"--device cuda: .*planned for the host only.*cuda target"
    with pytest.raises(DeviceError, match=why):
        _session(cpu_bundle, device="cuda")


def _bound_kernels(session):
    from edgepack.kernels.registry import lookup, node_dtype
    from edgepack.runtime.device import node_backend

    ex = session.executor
    for node in ex.graph["nodes"]:
        b = node_backend(node, ex.device)
        yield node, lookup(node["op"], node_dtype(node["op"], node["kernel"]["dtype"]), b)


def _cli(*args, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = cli_env(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.cuda
def test_cli_device_flags_without_a_gpu(tmp_path, cuda_bundles, cpu_bundle):
    x = np.zeros((1, 1, 8, 8), np.float32)
    np.save(tmp_path / "x.npy", x)
    nogpu = {"EDGEPACK_NO_GPU": "1"}
    r = _cli("run", cuda_bundles["fp32"], "-i", tmp_path / "x.npy", env_extra=nogpu)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("no usable GPU") == 1, r.stderr
    assert "prediction: class" in r.stdout
    r = _cli(
        "run", cuda_bundles["fp32"], "-i", tmp_path / "x.npy", "--require-gpu", env_extra=nogpu
    )
    assert r.returncode == 1
    assert "edgepack: error: a GPU is required (--require-gpu)" in r.stderr
    r = _cli("run", cuda_bundles["fp32"], "-i", tmp_path / "x.npy", "--device", "cpu")
    assert r.returncode == 0 and "no usable GPU" not in r.stderr, r.stderr
    r = _cli("run", cpu_bundle, "-i", tmp_path / "x.npy", "--device", "cuda")
    assert r.returncode == 1, r.stderr
    assert "error: --device cuda: this bundle was planned for the host only" in r.stderr
    r = _cli("bench", cuda_bundles["fp32"], "-n", "2", "--warmup", "1", env_extra=nogpu)
    assert r.returncode == 0 and "device cpu" in r.stdout, r.stderr


_NO_GPU_IMPORTS = """
import sys
from edgepack.runtime.session import Session
import numpy as np
s = Session(sys.argv[1], threads=1, device=sys.argv[2] if len(sys.argv) > 2 else None)
i = s.inputs[0]
s.run({i["name"]: np.zeros(i["shape"], np.float32)})
bad = [m for m in ("cupy", "numba.cuda") if m in sys.modules]
assert not bad, bad
print("ok", s.device)
"""


def test_cpu_path_imports_neither_cupy_nor_numba_cuda(cpu_bundle, cuda_bundles):
    for args in ([cpu_bundle], [cuda_bundles["fp32"], "cpu"]):
        r = subprocess.run(
            [sys.executable, "-c", _NO_GPU_IMPORTS, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and "ok cpu" in r.stdout, r.stderr


# --- packager: plan, budget, stub -----------------------------------------------------------


def test_cuda_plan_reserves_scratch_for_kernel_and_fallback(cuda_bundles):
    """int8 for a cuda target: every node records a cpu fallback, and its planned
    scratch covers both kernels (the cuda linear decodes int8 into scratch, the cpu
    one does not)."""
    from edgepack.kernels.registry import lookup, node_dtype
    from edgepack.runtime.bundle import open_bundle

    b = open_bundle(cuda_bundles["int8"])
    m, w = b.manifest, b.weights
    shapes = {k: tuple(v["shape"]) for k, v in m["graph"]["tensors"].items()}
    grew = 0
    for node in m["graph"]["nodes"]:
        k = node["kernel"]
        assert k["backend"] == "cuda" and k["fallback"]["backend"] == "cpu", node["name"]
        specs = [
            None
            if not t
            else ((tuple(w[t].shape), _short(w[t].dtype)) if t in w else (shapes[t], "f32"))
            for t in node["inputs"]
        ]
        outs = [shapes[o] for o in node["outputs"]]
        dt = node_dtype(node["op"], k["dtype"])
        needs = [lookup(node["op"], dt, x).scratch(specs, outs, node["attrs"]) for x in BOTH]
        planned = m["plan"]["scratch"].get(node["name"], [0, 0])[1]
        assert planned >= max(needs), (node["name"], needs, planned)
        grew += needs[0] > needs[1]
    assert grew, "expected a node (the int8 linear) whose cuda scratch exceeds the cpu one"


def _short(dt) -> str:
    return {"float32": "f32", "float16": "f16", "int8": "i8"}[np.dtype(dt).name]


def test_unified_memory_budget_counts_host_and_device(tmp_path):
    from dataclasses import replace
    from types import SimpleNamespace

    from edgepack.packager.ir import PackError
    from edgepack.packager.target_build import check_budget, memory_parts
    from edgepack.targets import load_target

    orin = load_target("jetson-orin-nano")
    assert orin.cuda is not None and orin.cuda.unified_memory
    mib = 2**20
    result = SimpleNamespace(plan=SimpleNamespace(arena_bytes=1000 * mib), weight_bytes=1000 * mib)
    parts = memory_parts(result, orin)
    assert parts == {
        "host arena": 1000 * mib,
        "device arena": 1000 * mib,
        "weights": 1000 * mib,
        "device weights": 1000 * mib,
    }
    tight = replace(orin, memory_budget_mb=3000)  # 2000 MiB would do on a host-only board
    with pytest.raises(
        PackError,
        match=r"over target jetson-orin-nano's memory budget of "
        r"3000 MiB \(CPU and GPU share it\)",
    ):
        check_budget(result, tight)
    check_budget(result, replace(orin, memory_budget_mb=4000))
    # The same numbers on a board without cuda count the host only.
    host_only = replace(load_target("rpi5"), memory_budget_mb=3000)
    assert memory_parts(result, host_only) == {"arena": 1000 * mib, "weights": 1000 * mib}
    check_budget(result, host_only)
    # A discrete GPU (unified_memory false) has its own memory: the host budget is as before.
    discrete = replace(orin, cuda=replace(orin.cuda, unified_memory=False))
    assert len(memory_parts(result, discrete)) == 2


def test_cuda_stub_carries_cupy_for_the_device_cuda():
    from edgepack.packager.stub import EXCLUDES, cuda_packages, stub_modules
    from edgepack.targets import load_target

    assert cuda_packages(load_target("jetson-orin-nano")) == ["cupy-cuda12x", "numba", "llvmlite"]
    assert cuda_packages(load_target("jetson-xavier-nx"))[0] == "cupy-cuda11x"
    assert cuda_packages(load_target("rpi5")) == []
    hidden, excludes = stub_modules(load_target("jetson-orin-nano"))
    assert {"cupy", "numba.cuda", "edgepack.kernels.cuda.kernels"} <= set(hidden)
    assert "numba" not in excludes and "llvmlite" not in excludes
    hidden, excludes = stub_modules(load_target("rpi5"))
    assert "cupy" not in hidden and excludes == EXCLUDES
    assert "edgepack.kernels.cuda.backend" in hidden  # registration only, no GPU code


def test_gpu_scripts_exit_cleanly_without_a_gpu(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--out", str(tmp_path / "g.md")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "EDGEPACK_NO_GPU": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "no usable GPU" in r.stdout + r.stderr
    assert not (tmp_path / "g.md").exists()


@pytest.mark.cuda
def test_simulated_kernel_modules_have_their_warning_registry_before_any_kernel_runs():
    """A warning's first registry would otherwise be inserted into a module's globals
    while another simulated thread iterates them (kernels/cuda/kernels.py says why)."""
    code = ("import edgepack.kernels.cuda.kernels as K, edgepack.kernels.portable as P; "
            "print(all('__warningregistry__' in vars(m) for m in (K, P)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr
