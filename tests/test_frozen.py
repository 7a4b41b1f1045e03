"""Device executables: a frozen runtime stub with the bundle appended.

Builds the host target's stub once (PyInstaller, ~1 min), then checks what a user
flashing a board relies on: it runs with no Python on PATH and answers exactly as
`edgepack run`; tampering, wrong stubs, over-budget models and bad signatures are
refused with a message that says what to do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, bench_rounds, load
from edgepack.packager.stub import __version__, _deterministic_targz, _launcher, host_arch

pytestmark = [
    pytest.mark.frozen,
    pytest.mark.xdist_group("frozen"),  # one worker builds the stub once (scripts/test.sh)
    pytest.mark.skipif(host_arch() != "x86_64", reason="the test target is linux-x86_64"),
]
TARGET = "linux-x86_64"
DIGITS = DATA / "digits_cnn.onnx"


def ep(*args, ok=True, env=None, cwd=None) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=cwd,
    )
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def stub_cache(tmp_path_factory):
    """A private stub cache holding a freshly frozen host stub: the first executable
    built into the empty cache freezes it (what a user's first `edgepack build --target`
    does), with its progress and the stub's size and time printed."""
    cache = tmp_path_factory.mktemp("stubs")
    old = os.environ.get("EDGEPACK_STUB_CACHE")
    os.environ["EDGEPACK_STUB_CACHE"] = str(cache)
    out = tmp_path_factory.mktemp("first") / "digits-first"
    r = ep("build", DIGITS, "--target", TARGET, "-o", out)
    assert f"the stub cache has none for target {TARGET}: freezing one" in r.stdout, r.stdout
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in r.stdout
    assert re.search(r"MB unpacked\), needs glibc [\d.]+; \d+s", r.stdout), r.stdout
    assert (cache / f"{TARGET}-{__version__}").is_dir() and out.is_file()
    yield cache
    if old is None:
        os.environ.pop("EDGEPACK_STUB_CACHE", None)
    else:
        os.environ["EDGEPACK_STUB_CACHE"] = old


@pytest.fixture(scope="module")
def digits_exe(stub_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("exe") / f"digits-{TARGET}"
    ep("build", DIGITS, "--target", TARGET, "--quant", "int8", "-o", out)
    return out


def _no_python_path(tmp: Path) -> str:
    """A PATH with only the tools the launcher uses (no python anywhere on it)."""
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    for tool in ("sh", "tail", "head", "gzip", "tar", "mkdir", "mktemp", "mv", "rm", "chmod", "id"):
        src = shutil.which(tool)
        assert src, tool
        (bin_ / tool).symlink_to(src)
    assert not any("python" in p.name for p in bin_.iterdir())
    return str(bin_)


def test_executable_runs_without_python_and_matches_edgepack_run(
    tmp_path, digits_exe, digit_inputs
):
    work = tmp_path / "cwd"
    work.mkdir()
    env = {"PATH": _no_python_path(tmp_path), "EDGEPACK_CACHE_DIR": str(tmp_path / "cache")}
    for attempt in ("first start (unpacks the runtime)", "second start"):
        r = subprocess.run(
            [
                "env",
                "-i",
                *(f"{k}={v}" for k, v in env.items()),
                str(digits_exe),
                "run",
                "--input",
                str(digit_inputs),
                "--output",
                str(work / "y.npz"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=work,
        )
        assert r.returncode == 0, (attempt, r.stderr[-3000:])
    assert sorted(p.name for p in work.iterdir()) == ["y.npz"]  # nothing else written here
    ep("run", digits_exe, "--input", digit_inputs, "--output", tmp_path / "ref.npz")
    with np.load(work / "y.npz") as got, np.load(tmp_path / "ref.npz") as ref:
        assert got.files == ref.files == ["logits"]
        assert np.array_equal(got["logits"], ref["logits"])  # bit for bit


def test_version_info_and_bench_inside_the_executable(tmp_path, digits_exe, digit_inputs):
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([str(digits_exe), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"target {TARGET}" in r.stdout and "bundle " in r.stdout
    r = subprocess.run([str(digits_exe), "info"], capture_output=True, text=True, env=env)
    assert "quant:    int8" in r.stdout and "stub" not in r.stderr
    r = subprocess.run(
        [str(digits_exe), "bench", "-n", "5", "--warmup", "1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0 and "median" in r.stdout
    # the rounds scripts/bench_cnn.py drives the executable with, on the same inputs
    got = bench_rounds([str(digits_exe), "bench", "--rounds", "--input", str(digit_inputs)],
                       tmp_path, env)  # fmt: skip
    ep("run", digits_exe, "--input", digit_inputs, "--output", tmp_path / "ref.npz")
    with np.load(tmp_path / "ref.npz") as ref:
        assert np.array_equal(got["logits"], ref["logits"])


def test_the_executable_picks_its_kernel_build_from_the_cpu(tmp_path, digits_exe, digit_inputs):
    """linux-x86_64 executables carry kernels for x86-64-v4 (AVX-512 with VNNI) and for
    the target's x86-64-v3, and take the first the CPU has (EDGEPACK_CPU_FLAGS plays
    another CPU): both builds give the same bits, and a CPU below v3 is refused with
    what it lacks before any kernel runs."""
    from edgepack.kernels.cpu.native import host_cpu_flags

    v4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    host = "x86-64-v4" if v4 <= (host_cpu_flags() or set()) else "x86-64-v3"
    outs = {}
    for flags, build in ((None, host), ("avx2 fma f16c sse2", "x86-64-v3")):
        env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
        env.pop("EDGEPACK_CPU_FLAGS", None)
        if flags:
            env["EDGEPACK_CPU_FLAGS"] = flags
        r = subprocess.run([str(digits_exe), "bench", "-n", "2", "--warmup", "1"],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert r.returncode == 0 and f"kernels built for {build})" in r.stdout, r.stderr[-2000:]
        out = tmp_path / f"{build}.npz"
        run = [str(digits_exe), "run", "--input", str(digit_inputs), "--output", str(out)]
        r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        with np.load(out) as y:
            outs[flags] = y["logits"]
    assert np.array_equal(outs[None], outs["avx2 fma f16c sse2"])
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"), EDGEPACK_CPU_FLAGS="sse2")
    r = subprocess.run([str(digits_exe), "run", "--input", str(digit_inputs)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 1
    assert "this CPU lacks avx2, f16c, fma, which the kernels of this executable need " \
        "(built for x86-64-v3)" in r.stderr, r.stderr[-2000:]


def test_tampered_payload_is_refused_even_after_a_verified_start(
    tmp_path, digits_exe, digit_inputs
):
    exe = tmp_path / "exe"
    shutil.copy(digits_exe, exe)
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    run = [str(exe), "run", "--input", str(digit_inputs)]
    assert subprocess.run(run, capture_output=True, env=env).returncode == 0  # verified once
    data = bytearray(exe.read_bytes())
    data[-4096] ^= 0x01  # inside the bundle's weights
    exe.write_bytes(bytes(data))
    r = subprocess.run(run, capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "weight checksum mismatch" in r.stderr


def _fake_stub(path: Path, arch_machine: int, meta_arch: str) -> Path:
    """A stub whose runtime is one ELF header of the given machine (never executed)."""
    root = path.parent / "fake-root"
    root.mkdir()
    elf = bytearray(64)
    elf[:4] = b"\x7fELF"
    elf[4], elf[5], elf[6] = 2, 1, 1  # 64-bit, little-endian, version 1
    elf[16:18] = (3).to_bytes(2, "little")  # ET_DYN
    elf[18:20] = arch_machine.to_bytes(2, "little")
    elf[20:24] = (1).to_bytes(4, "little")
    elf[52:54] = (64).to_bytes(2, "little")  # e_ehsize
    (root / "edgepack-rt").write_bytes(bytes(elf))
    archive = _deterministic_targz(root)
    import hashlib

    meta = {
        "format": 1,
        "target": "fake",
        "arch": meta_arch,
        "cpu": "generic",
        "edgepack": "0",
        "python": "3.11",
        "glibc": "2.17",
        "glibc_file": "",
        "unpacked_bytes": 64,
        "stub_id": hashlib.sha256(archive).hexdigest()[:16],
    }
    path.write_bytes(_launcher(meta, archive) + archive)
    return path


def test_wrong_architecture_stub_is_refused(tmp_path, stub_cache):
    fake = _fake_stub(tmp_path / "arm-stub", 183, "aarch64")
    r = ep("build", DIGITS, "--target", TARGET, "--stub", fake, "-o", tmp_path / "x", ok=False)
    assert r.returncode == 1
    assert "is built for aarch64, but target linux-x86_64 is x86_64" in r.stderr
    assert not (tmp_path / "x").exists()
    # and an arm board's target with no stub cached: the build makes the arm64 sysroot
    # to assemble one; where that cannot work (here: no Debian tools on PATH), it says
    # what failed, how to make it by hand, and where else to get a stub (--stub)
    env = dict(os.environ, EDGEPACK_AARCH64_ROOT=str(tmp_path / "no-sysroot"),
               PATH=str(tmp_path / "empty-path"))  # fmt: skip
    r = ep("build", DIGITS, "--target", "rpi5", "-o", tmp_path / "y", ok=False, env=env)
    assert r.returncode == 1
    assert "making them (once" in r.stdout, r.stdout
    assert "making the aarch64 sysroot failed" in r.stderr, r.stderr
    assert "aarch64_sysroot.sh" in r.stderr and "--stub" in r.stderr, r.stderr
    assert not (tmp_path / "y").exists()


def test_stub_from_other_runtime_sources_is_refused(tmp_path):
    # same version, right architecture, but frozen from other sources (e.g. a stub cached
    # before the kernels changed): its AOT kernels may lack ones the plan needs
    fake = _fake_stub(tmp_path / "old-stub", 62, "x86_64")
    r = ep("build", DIGITS, "--target", TARGET, "--stub", fake, "-o", tmp_path / "x", ok=False)
    assert r.returncode == 1
    assert "frozen from other edgepack runtime sources (not recorded" in r.stderr
    assert "edgepack stub --target linux-x86_64" in r.stderr
    assert not (tmp_path / "x").exists()


def _custom_target(tmp_path: Path, name: str, **changes) -> Path:
    src = Path(__file__).resolve().parents[1] / "targets" / f"{TARGET}.toml"
    lines = []
    for line in src.read_text().splitlines():
        key = line.split("=")[0].strip()
        if key == "name":
            line = f'name = "{name}"'
        elif key in changes:
            line = f"{key} = {changes[key]}"
        lines.append(line)
    p = tmp_path / f"{name}.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def refused_build(model: Path, target: Path, stub_cache: Path, tmp_path: Path, *extra) -> str:
    """Build for a custom target with the host stub; must fail: returns stderr."""
    stub = next(stub_cache.glob(f"{TARGET}-*/stub"))
    out = tmp_path / "x"
    r = ep("build", model, "--target", target, "--stub", stub, "-o", out, *extra, ok=False)
    assert r.returncode == 1 and not out.exists()
    return r.stderr


def test_stub_needing_newer_glibc_is_refused(tmp_path, stub_cache):
    old_os = _custom_target(tmp_path, "old-distro", min_glibc='"2.17"')
    err = refused_build(DIGITS, old_os, stub_cache, tmp_path)
    assert "needs glibc 2.35" in err and "guarantees only glibc 2.17" in err


def test_model_over_memory_budget_is_refused(tmp_path, stub_cache, model_dir):
    small = _custom_target(tmp_path, "tiny-board", memory_budget_mb="16")
    err = refused_build(model_dir / "resnet18.onnx", small, stub_cache, tmp_path, "--quant", "fp32")
    assert "over target tiny-board's memory budget of 16 MiB" in err and "--quant int8" in err


def test_op_without_kernel_on_target_backends_is_refused(tmp_path, stub_cache):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Pad", ["x", "p"], ["y"], name="mirror_pad", mode="reflect")],
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("p", TensorProto.INT64, [8], [0, 0, 1, 1, 0, 0, 1, 1])],
    )
    model = tmp_path / "pad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    cpu_only = _custom_target(tmp_path, "cpu-only", backends='["cpu"]')
    err = refused_build(model, cpu_only, stub_cache, tmp_path)
    assert "node 'mirror_pad'" in err and "no kernel for op 'pad'" in err


def test_signatures(tmp_path, stub_cache, digit_inputs):
    ep("keygen", "-o", tmp_path / "release")
    ep("keygen", "-o", tmp_path / "other")
    assert oct((tmp_path / "release.key").stat().st_mode & 0o777) == "0o600"
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    signed, unsigned, locked = tmp_path / "signed", tmp_path / "unsigned", tmp_path / "locked"
    ep("build", DIGITS, "--target", TARGET, "-o", signed, "--sign", tmp_path / "release.key")
    ep("build", DIGITS, "--target", TARGET, "-o", unsigned)
    ep(
        "build",
        DIGITS,
        "--target",
        TARGET,
        "-o",
        locked,
        "--embed-pubkey",
        tmp_path / "release.pub",
    )

    def run(exe, *extra):
        return subprocess.run(
            [str(exe), "run", "--input", str(digit_inputs), *map(str, extra)],
            capture_output=True,
            text=True,
            env=env,
        )

    assert run(signed, "--require-signature", tmp_path / "release.pub").returncode == 0
    r = run(signed, "--require-signature", tmp_path / "other.pub")
    assert r.returncode == 1 and "bad signature" in r.stderr
    r = run(unsigned, "--require-signature", tmp_path / "release.pub")
    assert r.returncode == 1 and "not signed" in r.stderr
    r = run(locked)  # embedded key, unsigned payload
    assert r.returncode == 1 and "not signed" in r.stderr
    # A plain .epk can be signed too, and `edgepack run` checks it.
    ep("build", DIGITS, "-o", tmp_path / "d.epk", "--sign", tmp_path / "release.key")
    ep(
        "run",
        tmp_path / "d.epk",
        "--input",
        digit_inputs,
        "--require-signature",
        tmp_path / "release.pub",
    )
    r = ep(
        "run",
        tmp_path / "d.epk",
        "--input",
        digit_inputs,
        "--require-signature",
        tmp_path / "other.pub",
        ok=False,
    )
    assert r.returncode == 1 and "bad signature" in r.stderr


@pytest.mark.slow
def test_one_gigabyte_payload(tmp_path, stub_cache):
    """A 1 GiB weight rides along; the executable still starts and finds its bundle."""
    from edgepack.packager.executable import assemble
    from edgepack.packager.writer import write_bundle
    from test_bundle_format import tiny_manifest

    manifest, weights = tiny_manifest()
    weights["big"] = np.ones(256 * 2**20, np.float32)  # 1 GiB
    manifest["weights"]["big"] = {"shape": [256 * 2**20], "dtype": "f32"}
    write_bundle(tmp_path / "big.epk", manifest, weights)
    del weights
    exe = assemble(
        next(stub_cache.glob(f"{TARGET}-*/stub")), tmp_path / "big.epk", tmp_path / "big-exe"
    )
    (tmp_path / "big.epk").unlink()
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    for _ in range(2):  # first start verifies 1 GiB, the second trusts the record
        r = subprocess.run([str(exe), "info"], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        assert "params:   268,435,463" in r.stdout


@pytest.mark.mqtt
def test_serve_inside_the_executable(tmp_path, digits_exe, digit_inputs):
    """The MQTT agent and the HTTP server run from the executable too, answering as
    `edgepack run` does."""
    import signal

    import httpx
    import mqtt_broker as mb

    from edgepack.client import Client

    if not mb.have_mosquitto():
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    broker = mb.Broker(tmp_path / "broker").start()
    watcher = mb.StatusWatcher(broker.url)
    log = open(tmp_path / "agent.log", "wb")
    port = mb.free_port()
    agent = subprocess.Popen(
        [str(digits_exe), "serve", "--broker", broker.url, "--device", "exe-1", "--threads", "1",
         "--http", f"127.0.0.1:{port}"],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache")),
    )
    try:
        watcher.wait("exe-1", "online", timeout=120)
        x = np.load(digit_inputs)
        with Client(broker.url) as client:
            got = client.submit({"image": x}, device="exe-1", timeout=30, retries=2).result()
        body = {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}  # fmt: skip
        r = httpx.post(f"http://127.0.0.1:{port}/v2/models/digits_cnn/infer", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        ep("run", digits_exe, "--input", digit_inputs, "--output", tmp_path / "ref.npz")
        with np.load(tmp_path / "ref.npz") as ref:
            assert np.array_equal(got["logits"], ref["logits"])
            assert np.array_equal(np.float32(out["data"]).reshape(out["shape"]), ref["logits"])
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        watcher.wait("exe-1", "offline", timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
        watcher.close()
        broker.stop()


def _winograd_onnx(path: Path) -> None:
    """conv 3x3 16->16 at 28x28 (F(4x4)), stride-2 conv to 14x14, conv 3x3 at 14x14
    (F(2x2)) with a residual add and ReLUs: every Winograd kernel of the AOT build."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)

    def w(name, *shape):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    inits = [
        w("w0", 16, 3, 3, 3),
        w("w1", 16, 16, 3, 3),
        w("w2", 16, 16, 3, 3),
        w("w3", 16, 16, 3, 3),
        w("b1", 16),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["c2", "w3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "c2"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "wino",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 14, 14])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _inside_and_jit(tmp_path: Path, exe: Path, x: Path, name: str):
    """(output ``name`` of ``exe run`` (its AOT kernels), the same from ``edgepack run``
    on the executable (the JIT kernels))."""
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run(
        [str(exe), "run", "--input", str(x), "--output", str(tmp_path / "got.npz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ep("run", exe, "--input", x, "--output", tmp_path / "ref.npz")
    with np.load(tmp_path / "got.npz") as got, np.load(tmp_path / "ref.npz") as ref:
        return got[name], ref[name]


def test_winograd_convs_in_the_executable_match_edgepack_run(tmp_path, stub_cache):
    """The AOT-compiled Winograd kernels give the JIT build's answer bit for bit."""
    model = tmp_path / "wino.onnx"
    _winograd_onnx(model)
    exe = tmp_path / "wino-exe"
    r = ep("build", model, "--target", TARGET, "-o", exe)
    assert "2 3x3 conv(s) -> Winograd" in r.stdout
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(4).standard_normal((1, 3, 28, 28)).astype(np.float32))
    got, ref = _inside_and_jit(tmp_path, exe, x, "y")
    assert np.array_equal(got, ref)


def _chain_onnx(path: Path) -> None:
    """An inverted residual block big enough to fuse (packager/mbconv.py: its expanded
    tensor 48x48x96 is 864 KB): expand 1x1 16->96, depthwise 3x3, project 1x1 96->16,
    ReLU6s and the residual add."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)

    def w(name, *shape):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    inits = [w("we", 96, 16, 1, 1), w("be", 96), w("wd", 96, 1, 3, 3), w("bd", 96),
             w("wp", 16, 96, 1, 1), w("bp", 16)]  # fmt: skip
    inits += [numpy_helper.from_array(np.float32(v), n) for n, v in (("lo", 0), ("hi", 6))]
    nodes = [
        helper.make_node("Conv", ["x", "we", "be"], ["e"]),
        helper.make_node("Clip", ["e", "lo", "hi"], ["e6"]),
        helper.make_node("Conv", ["e6", "wd", "bd"], ["d"], group=96, pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["d", "lo", "hi"], ["d6"]),
        helper.make_node("Conv", ["d6", "wp", "bp"], ["p"]),
        helper.make_node("Add", ["p", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 48, 48])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 48, 48])], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("quant", ["fp32", "fp16"])
def test_a_fused_chain_in_the_executable_matches_edgepack_run(tmp_path, stub_cache, quant):
    """The AOT build's one-region chain kernel (gemm_tiles.mbconv_rows, float32 and fp16
    panels) gives the JIT build's answer bit for bit."""
    model = tmp_path / "chain.onnx"
    _chain_onnx(model)
    exe = tmp_path / f"chain-{quant}"
    ep("build", model, "--target", TARGET, "--quant", quant, "--quant-min-weights", "0", "-o", exe)
    nodes = load(exe).manifest["graph"]["nodes"]
    assert [n["kernel"].get("variant") for n in nodes if n["op"] == "mbconv"] == ["rows"]
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(6).standard_normal((1, 16, 48, 48)).astype(np.float32))
    got, ref = _inside_and_jit(tmp_path, exe, x, "y")
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("quant", ["int4", "bf16"])
def test_new_weight_types_in_the_executable_match_edgepack_run(
    tmp_path, stub_cache, digit_inputs, quant
):
    """The AOT build exports the int4 GEMV and decoders and the bf16 decoder. bf16 gives
    the JIT build's answer bit for bit; the int4 GEMV sums in vector lanes, so the
    target's vector width (the AOT build's) rounds differently from the host's."""
    exe = tmp_path / f"digits-{quant}"
    ep("build", DIGITS, "--target", TARGET, "--quant", quant, "--quant-min-weights", "0", "-o", exe)
    got, ref = _inside_and_jit(tmp_path, exe, digit_inputs, "logits")
    if quant == "bf16":
        assert np.array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_int8_activations_in_the_executable_match_edgepack_run(
    tmp_path, stub_cache, digit_inputs
):
    """int8 x int8 convs (--act-quant int8): the executable's v4 build (VNNI) and v3
    build (AVX2 pairs) and the JIT give the same bits, the integer sums being exact."""
    exe = tmp_path / "digits-int8x8"
    r = ep("build", DIGITS, "--target", TARGET, "--quant", "int8", "--act-quant", "int8",
           "--quant-min-weights", "0", "-o", exe)  # fmt: skip
    assert "take u8 activations" in r.stdout
    got, ref = _inside_and_jit(tmp_path, exe, digit_inputs, "logits")
    assert np.array_equal(got, ref)
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"),
               EDGEPACK_CPU_FLAGS="avx2 fma f16c sse2")  # fmt: skip
    out = tmp_path / "v3.npz"
    r = subprocess.run([str(exe), "run", "--input", str(digit_inputs), "--output", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    with np.load(out) as y:
        assert np.array_equal(y["logits"], ref)


def _word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json and a chat template for a test model's folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<s>", "</s>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(vocab - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    cfg = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


# slow: 90-100 s of the default run; the executable's CNN, weight-type and int8
# activation tests stay in it, and tests/test_stub_aarch64.py's SmolLM2 one is slow too
@pytest.mark.slow
def test_a_language_model_in_the_executable_matches_edgepack_run(tmp_path, stub_cache):
    """An LLM bundle in the target's stub (--target): info, bench, run and generate work
    inside it, and its decode step (the AOT kernels: int8 GEMV, the int4 x int8 products
    on the target's AVX2 family, attention, norms) gives the JIT build's logits bit for
    bit, so a seeded sampled chat (the stub's tokenizers and jinja2) gives the same
    text as ``edgepack generate`` on the executable."""
    from test_llm_e2e import VOCAB, _llama

    _llama(tmp_path / "hf", tied=True, bias=True)
    _word_tokenizer(tmp_path / "hf", VOCAB)
    exe = tmp_path / "tiny-llm"
    r = ep("build", tmp_path / "hf", "--target", TARGET, "--quant", "int4", "--ctx", "32",
           "--chunk", "4", "-o", exe)  # fmt: skip
    assert "executable for linux-x86_64" in r.stdout
    env = dict(os.environ, EDGEPACK_CACHE_DIR=str(tmp_path / "cache"))
    info = subprocess.run([str(exe), "info"], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert info.returncode == 0 and "KV cache" in info.stdout, info.stderr[-2000:]
    assert "activations int8 in blocks of 32" in info.stdout  # the target has AVX2
    args = [str(exe), "bench", "--pp", "4", "--tg", "3", "--depth", "0", "-r", "1"]
    bench = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert bench.returncode == 0 and "tg3" in bench.stdout, bench.stderr[-2000:]
    x = tmp_path / "step.npz"
    np.savez(x, ids=np.array([7], np.int32), pos=np.array([0], np.int32),
             slot=np.array([0], np.int32))  # fmt: skip
    got, ref = _inside_and_jit(tmp_path, exe, x, "logits")
    assert np.array_equal(got, ref)
    gen = ["generate", "-p", "w3 w17 w5", "--chat", "-n", "12", "--temp", "0.9", "--seed", "5"]
    inside = subprocess.run([str(exe), *gen], capture_output=True, text=True, env=env,
                            timeout=300)  # fmt: skip
    assert inside.returncode == 0, inside.stderr[-2000:]
    assert "decode:" in inside.stderr and inside.stdout.strip()
    assert inside.stdout == ep(gen[0], exe, *gen[1:]).stdout
