"""The CPU kernels on aarch64, on an x86_64 host, under user-mode qemu (slow).

Builds (once; idempotent) the Debian arm64 sysroot with scripts/aarch64_sysroot.sh,
then runs scripts/check_kernels_aarch64.py: every (op, dtype) cpu kernel of the
dispatch table against the NumPy reference, with the cases and runner of
tests/test_kernels.py: numba's JIT compiling for a Raspberry Pi 4's cortex-a72 on a
qemu cortex-a72, and the kernels a Raspberry Pi 5 stub ships, compiled ahead of time on
this host (packager/aot_cross.py), on a qemu cortex-a76. Needs Debian's apt (arm64
packages, qemu-user-static), PyPI (aarch64 wheels) and root or sudo the first time;
takes about 10 minutes each. Run with ``pytest -m slow tests/test_aarch64.py``.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from edgepack.packager.aot_cross import sysroot

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"aarch64 kernel check: (\d+) passed, (\d+) failed")


@pytest.mark.slow
@pytest.mark.parametrize("how", [[], ["--target", "rpi5", "--aot"]], ids=["jit-rpi4", "aot-rpi5"])
def test_cpu_kernels_match_reference_on_aarch64(tmp_path: Path, how: list[str]) -> None:
    if sys.platform != "linux":
        pytest.skip("needs Linux (user-mode qemu)")
    if not shutil.which("qemu-aarch64-static") and not shutil.which("apt-get"):
        pytest.skip("needs qemu-aarch64-static, or apt-get to install it")
    if platform.machine() == "aarch64":
        pytest.skip("on aarch64 itself tests/test_kernels.py checks the kernels natively")
    root = str(sysroot())
    setup = subprocess.run(
        ["bash", str(REPO / "scripts/aarch64_sysroot.sh"), root],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert setup.returncode == 0, f"sysroot setup failed:\n{setup.stdout}\n{setup.stderr}"
    assert "on aarch64 under qemu" in setup.stdout, setup.stdout

    check = subprocess.run(
        [sys.executable, str(REPO / "scripts/check_kernels_aarch64.py"), "--sysroot", root, *how],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = check.stdout + check.stderr
    lines = check.stdout.strip().splitlines()
    m = SUMMARY.fullmatch(lines[-1]) if lines else None
    assert m, f"no summary line (exit status {check.returncode}):\n{out[-6000:]}"
    passed, failed = int(m[1]), int(m[2])
    assert failed == 0, f"{failed} kernel checks failed on aarch64:\n{out[-6000:]}"
    # every cpu kernel of the (host's) dispatch table was run, and passed
    from edgepack.kernels import registry

    registry._load_backends()
    keys = sorted(f"{op}/{dt}" for (op, dt, b) in registry.KERNELS if b == "cpu")
    reported = dict(re.findall(r"^(\w+/\w+): (\d+) passed, 0 failed", check.stdout, re.M))
    missing = [k for k in keys if int(reported.get(k, 0)) == 0]
    assert not missing, f"no passing aarch64 checks for {missing}:\n{out[-6000:]}"
    assert passed >= len(keys)
    assert check.returncode == 0, out[-6000:]


@pytest.mark.cpu
def test_cross_kernel_builds_name_what_they_miss(tmp_path: Path, monkeypatch) -> None:
    """A cross build (another architecture's kernels, packager/aot_cross.py) refuses
    before compiling anything, naming what is missing and how to get it."""
    from edgepack.packager.aot import ensure_kernel_builds
    from edgepack.packager.aot_cross import toolchain
    from edgepack.packager.ir import PackError
    from edgepack.targets import load_target

    with pytest.raises(PackError, match="no cross build of the kernels for riscv64"):
        toolchain("riscv64")
    if platform.machine() == "aarch64":
        pytest.skip("aarch64 builds are native here")
    if sys.version_info[:2] != (3, 11):
        with pytest.raises(PackError, match="needs Python 3.11"):
            toolchain("aarch64")
        return
    monkeypatch.setenv("EDGEPACK_AARCH64_ROOT", str(tmp_path / "no-sysroot"))
    monkeypatch.setenv("EDGEPACK_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(PackError, match=r"arm64 Python headers.*aarch64_sysroot\.sh"):
        ensure_kernel_builds(load_target("rpi5"), log=lambda s: None)
    assert not (tmp_path / "cache").exists()  # nothing started


@pytest.mark.cpu
def test_jetpack5_is_refused_by_the_cross_route_with_what_to_do() -> None:
    """JetPack 5's glibc (2.31) is older than the assembled runtime needs (2.35): the
    build says so, and where to build that stub, before it builds anything."""
    from edgepack.packager.ir import PackError
    from edgepack.packager.stub import build_stub
    from edgepack.targets import load_target

    if platform.machine() == "aarch64":
        pytest.skip("the cross route is for x86_64 hosts")
    with pytest.raises(PackError, match=r"glibc 2\.31.*needs 2\.35.*on the board itself"):
        build_stub(load_target("jetson-xavier-nx"), log=lambda s: None)
