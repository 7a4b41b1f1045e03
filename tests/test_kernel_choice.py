"""Kernel choice is made at pack time and bound as recorded: each node's backend,
variant and fallback are in the bundle; the runtime refuses what it would not run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load, pack
from edgepack.kernels.registry import BACKEND_TABLE, wants
from edgepack.packager.build import build
from edgepack.runtime.bundle import BundleError
from edgepack.runtime.device import DeviceError
from edgepack.runtime.executor import Executor

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def digits_int4(tmp_path_factory, digits_onnx):
    out = tmp_path_factory.mktemp("choice") / "d.epk"
    return pack(digits_onnx, out, quant="int4", min_weights=0)


def _kinds(manifest) -> dict[str, dict]:
    return {n["name"]: n["kernel"] for n in manifest["graph"]["nodes"]}


def test_the_bundle_records_each_nodes_variant(digits_int4):
    kernels = _kinds(load(digits_int4).manifest)
    # channels-last 3x3 convs from a zero-padded copy, int4 decoded first; the linears
    # at batch 1 take the fused int4 GEMV
    assert kernels["conv3"]["variant"] == "decode_q4+padded_window"
    assert kernels["fc10"]["variant"] == kernels["fc12"]["variant"] == "gemv_q4"
    assert "variant" not in kernels["pool5"]  # a kernel with one way to run


def _bind_with_record(path, node: str, change) -> None:
    """Bind the bundle at ``path`` on the host with ``change(record)`` applied to one
    node's kernel record (a copy: the session's manifest is left alone)."""
    s = load(path)
    manifest = dict(s.manifest)
    manifest["graph"] = dict(manifest["graph"])
    nodes = [dict(n) for n in manifest["graph"]["nodes"]]
    for n in nodes:
        if n["name"] == node:
            n["kernel"] = change(dict(n["kernel"]))
    manifest["graph"]["nodes"] = nodes
    Executor(manifest, s.bundle.weights, device="cpu")


def test_a_variant_this_runtime_would_not_run_is_refused(digits_int4):
    with pytest.raises(BundleError, match="node 'fc10': the bundle records variant"):
        _bind_with_record(digits_int4, "fc10", lambda k: {**k, "variant": "decode_q4+blas"})


def test_a_cuda_node_without_a_host_fallback_is_refused_on_the_host(digits_int4, monkeypatch):
    monkeypatch.setenv("EDGEPACK_NO_GPU", "1")
    s = load(digits_int4)
    manifest = dict(s.manifest)
    manifest["graph"] = dict(manifest["graph"])
    nodes = [dict(n) for n in manifest["graph"]["nodes"]]
    nodes[1]["kernel"] = {"backend": "cuda", "dtype": nodes[1]["kernel"]["dtype"], "name": "x"}
    manifest["graph"]["nodes"] = nodes
    with pytest.raises(DeviceError, match=f"node {nodes[1]['name']!r}.*needs its GPU"):
        Executor(manifest, s.bundle.weights)


def test_graph_passes_follow_the_first_backend(tmp_path, digits_onnx):
    assert wants(("cpu", "ref"), "channels_last") and not wants(("cuda", "cpu"), "winograd")
    assert all(not row.passes for name, row in BACKEND_TABLE.items() if name != "cpu")
    cpu = build(digits_onnx, tmp_path / "c.epk", log=lambda s: None)
    gpu = build(
        digits_onnx, tmp_path / "g.epk", backends=("cuda", "cpu", "ref"), log=lambda s: None
    )
    layouts = lambda r: {n["attrs"].get("layout") for n in r.manifest["graph"]["nodes"]}  # noqa: E731
    assert "nhwc" in layouts(cpu) and "nhwc" not in layouts(gpu)
    fallbacks = [n["kernel"].get("fallback") for n in gpu.manifest["graph"]["nodes"]]
    assert all(f and f["backend"] == "cpu" for f in fallbacks)
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(np.float32)
    a = load(cpu.path).run({"image": x})["logits"]
    b = load(gpu.path).run({"image": x})["logits"]  # no GPU here: its cpu fallbacks
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_each_record_carries_its_own_scratch_and_the_plan_the_larger(tmp_path, digits_onnx):
    # No kernel reserves room for another: each record says what its own kernel takes
    # (int8 cuda linears decode their weights into scratch, the cpu GEMV needs none),
    # and the planner alone reserves the larger of a node's kernel and fallback.
    gpu = build(
        digits_onnx,
        tmp_path / "g.epk",
        quant="int8",
        backends=("cuda", "cpu", "ref"),
        min_weights=0,
        log=lambda s: None,
    )
    m = gpu.manifest
    differ = 0
    for n in m["graph"]["nodes"]:
        k, fb = n["kernel"], n["kernel"]["fallback"]
        reserved = m["plan"]["scratch"].get(n["name"], (0, 0))[1]
        assert reserved == max(k["scratch"], fb["scratch"]), n["name"]
        differ += k["scratch"] != fb["scratch"]
    assert differ  # the case the rule is for occurs in this bundle


def test_a_recorded_scratch_this_runtime_would_not_take_is_refused(digits_int4):
    with pytest.raises(BundleError, match=r"node 'fc10': kernel cpu\.linear needs \d+ B"):
        _bind_with_record(digits_int4, "fc10", lambda k: {**k, "scratch": k["scratch"] + 64})


def test_a_node_the_device_backend_declines_fails_the_build(tmp_path, digits_onnx, monkeypatch):
    # A cuda plan runs every node on the GPU (no host hop mid-graph): a node the cuda
    # kernel declines is a pack-time error naming it, not a silent host node.
    import dataclasses

    from edgepack.kernels import registry
    from edgepack.packager.ir import PackError

    key = ("maxpool", "f32", "cuda")
    no = dataclasses.replace(registry.KERNELS[key], accepts=lambda attrs: False)
    monkeypatch.setitem(registry.KERNELS, key, no)
    with pytest.raises(PackError, match=r"node 'pool\d+'.*'maxpool' \(f32\) has no cuda kernel"):
        build(digits_onnx, tmp_path / "g.epk", backends=("cuda", "cpu", "ref"), log=lambda s: None)


def test_a_bundle_runs_on_the_kernels_its_build_compiled(tmp_path, digits_onnx):
    """A quantized build runs its graph on weights in memory (the error table), then
    `edgepack run` maps the bundle: both must call the same compiled kernels. numba
    compiles per argument type, read-only included; writable weights in the build once
    made the first run compile every conv GEMM again (~30 s each, cold)."""
    import numba
    from edgepack.kernels.cpu.native import K
    from edgepack.runtime.threads import set_threads

    def compiled() -> dict[str, int]:
        out = {}
        for name, k in vars(K).items():
            for part in (k, getattr(k, "serial", None), getattr(k, "parallel", None)):
                if isinstance(part, numba.core.dispatcher.Dispatcher):
                    out[f"{name}/{part.py_func.__qualname__}"] = len(part.overloads)
        return out

    set_threads(1)
    path = pack(digits_onnx, tmp_path / "d.epk", quant="int8")
    built = compiled()
    s = load(path, threads=1)
    x = np.random.default_rng(0).random(tuple(s.executor.inputs[0]["shape"]), np.float32)
    feeds = {s.executor.inputs[0]["name"]: x}
    want = {k: v.copy() for k, v in s.run(feeds).items()}
    assert compiled() == built
    assert sum(built.values()) > 0
    # and the other way round: weights in writable memory bind the mapped run's kernels
    writable = {k: np.array(v) for k, v in s.bundle.weights.items()}
    got = Executor(s.manifest, writable, device="cpu").run(feeds)
    assert compiled() == built
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
