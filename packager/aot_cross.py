"""Compile the CPU kernels ahead of time for another architecture (aarch64 on x86_64).

numba's ``pycc`` builds for the machine it runs on, and an aarch64 board is not where
users pack. Here one process is made to target aarch64 throughout: before numba loads,
llvmlite's idea of the host (triple, CPU name, CPU features) is replaced by the
target's, so every codegen lowers for it: pycc's own and the JIT's, which compiles the
helpers pycc links in (and whose triple kernels/cpu/atomics.py reads to choose the
pause and futex instructions). Retargeting pycc's codegen alone fails at instruction
selection on the first x86 helper (``llvm.x86.sse2.pause``). The process loads code
into LLVM's JIT but never calls any, so it runs in a fresh interpreter of its own
(``python -m edgepack.packager.aot``), never in the packager's.

pycc's C parts (its module helpers; numba's runtime, C++) and the link go through
Debian's aarch64 cross compiler, against the arm64 CPython and numpy headers of the
sysroot; both come from ``aarch64_sysroot.sh`` (SYSROOT and SYSROOT.cross; beside this
file, and run by ``ensure_toolchain`` when missing).
The extension needs libc and libm only, as on x86_64.

Measured (2-core EPYC, numba 0.68.1, llvmlite 0.50.0): three kernels and the pool
compile in 43.5 s cross against 45.6 s natively for x86-64-v3, and ``act_into`` built
for cortex-a76 gives the host JIT's bits under ``qemu-aarch64-static -cpu cortex-a76``;
a cortex-a76 build traps (SIGILL) on a cortex-a72, so the target's features reach the
code. The host's Python must be the sysroot's (3.11): pycc lays out the module's C-API
structures for the Python it runs in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .. import cache_dir
from .ir import PackError

TRIPLES = {"aarch64": "aarch64-unknown-linux-gnu"}
GNU = {"aarch64": "aarch64-linux-gnu"}  # Debian's multiarch and cross-tool prefix
PYTHON = (3, 11)  # the sysroot's (Debian bookworm)


def sysroot() -> Path:
    """The arm64 sysroot of aarch64_sysroot.sh: $EDGEPACK_AARCH64_ROOT, else
    ``aarch64-sysroot`` in edgepack's cache (beside it: ``.cross``, ``.board``)."""
    return Path(os.environ.get("EDGEPACK_AARCH64_ROOT") or cache_dir() / "aarch64-sysroot")


def _how() -> str:
    return ("make them with `bash scripts/aarch64_sysroot.sh` (in the package: "
            "edgepack/packager/aarch64_sysroot.sh; Debian's arm64 python3.11 "
            "and aarch64 cross compiler, unpacked; about 400 MB, no root needed when the "
            "arm64 dpkg architecture is enabled), or build the stub on the board and pass "
            "it with --stub")  # fmt: skip


def toolchain(arch: str) -> dict[str, str]:
    """The environment of a cross build for ``arch``: the compilers and the include
    folders (PackError naming what is missing)."""
    if arch not in TRIPLES:
        raise PackError(f"no cross build of the kernels for {arch} (known: {', '.join(TRIPLES)})")
    if sys.version_info[:2] != PYTHON:
        raise PackError(
            f"cross-compiling the kernels needs Python {PYTHON[0]}.{PYTHON[1]} on this machine "
            f"(the stub's; this is {sys.version_info[0]}.{sys.version_info[1]}): pycc lays out "
            "the extension for the Python it runs in"
        )
    gnu, root = GNU[arch], sysroot()
    py = f"python{PYTHON[0]}.{PYTHON[1]}"
    site = root / "usr/local/lib" / py / "dist-packages"
    need = {
        "arm64 Python headers": root / "usr/include" / py / "Python.h",
        "arm64 numpy headers": site / "numpy/_core/include/numpy/arrayobject.h",
    }
    env: dict[str, str] = {}
    on_path = shutil.which(f"{gnu}-gcc"), shutil.which(f"{gnu}-g++")
    if all(on_path):  # apt-get install g++-aarch64-linux-gnu
        cc, cxx = on_path
        ar, strip = (shutil.which(f"{gnu}-{t}") or t for t in ("ar", "strip"))
    else:  # the unpacked one beside the sysroot
        cross = Path(f"{root}.cross")
        cc = f"{cross}/usr/bin/{gnu}-gcc-12 --sysroot={cross}"
        cxx = f"{cross}/usr/bin/{gnu}-g++-12 --sysroot={cross}"
        ar, strip = f"{cross}/usr/bin/{gnu}-ar", f"{cross}/usr/bin/{gnu}-strip"
        need["cross compiler"] = cross / "usr/bin" / f"{gnu}-g++-12"
        libs = f"{cross}/usr/lib/x86_64-linux-gnu"  # binutils' own libraries
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libs, os.environ.get("LD_LIBRARY_PATH")) if p
        )
    missing = [what for what, f in need.items() if not f.is_file()]
    if missing:
        raise PackError(f"cross-compiling the kernels for {arch} needs {', '.join(missing)} "
                        f"in {root}: {_how()}")  # fmt: skip
    env.update(CC=cc, CXX=cxx, LDSHARED=f"{cc} -shared", AR=ar, STRIP=strip,
               CFLAGS="-O2 -fPIC",
               CPPFLAGS="", LDFLAGS="",
               EDGEPACK_CROSS_INCLUDE=os.pathsep.join(map(str, (
                   root / "usr/include", root / "usr/include" / py,
                   root / "usr/include" / gnu / py))),
               EDGEPACK_CROSS_NUMPY_INCLUDE=str(site / "numpy/_core/include"))  # fmt: skip
    return env


SETUP_SCRIPT = Path(__file__).with_name("aarch64_sysroot.sh")


def ensure_toolchain(arch: str, log: Callable[[str], None] = print) -> dict[str, str]:
    """``toolchain(arch)``, first making the sysroot and cross compiler when they are
    missing (the packaged ``aarch64_sysroot.sh``, its progress lines through ``log``;
    about 400 MB of Debian packages and wheels, once per machine)."""
    try:
        return toolchain(arch)
    except PackError:
        if arch not in TRIPLES or sys.version_info[:2] != PYTHON:
            raise  # nothing a sysroot would change
    root = sysroot()
    log(f"      no {arch} sysroot and cross compiler in {root}: making them (once; Debian "
        "arm64 packages, aarch64 wheels and the cross compiler, ~400 MB)")  # fmt: skip
    bash = shutil.which("bash") or "/bin/bash"
    env = dict(os.environ, PYTHON=sys.executable)  # the wheels pinned to this Python's
    proc = subprocess.Popen([bash, str(SETUP_SCRIPT), str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if line.startswith("[aarch64-sysroot]"):
            log(f"      {line.rstrip()}")
    if proc.wait():
        raise PackError(f"making the {arch} sysroot failed (exit status {proc.returncode}):\n"
                        + "\n".join(tail) + f"\n{_how()}")  # fmt: skip
    return toolchain(arch)


def compile_kernels_cross(out_dir: str | Path, arch: str, cpu: str, shape: str,
                          features: str, module: str) -> Path:  # fmt: skip
    """``aot.compile_kernels`` for ``arch`` in a process of its own (module doc)."""
    env = dict(os.environ, **toolchain(arch))
    env["NUMBA_CACHE_DIR"] = str(Path(out_dir) / ".numba-cache")  # never the host's cache
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    job = {"out": str(out_dir), "arch": arch, "cpu": cpu, "shape": shape,
           "features": features, "module": module}  # fmt: skip
    # aot.py's __main__: retarget_process, then the same compile_kernels as a host build
    r = subprocess.run([sys.executable, "-m", "edgepack.packager.aot", json.dumps(job)],
                       env=env, capture_output=True, text=True)  # fmt: skip
    shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)
    if r.returncode:
        raise PackError(f"cross-compiling the kernels for {arch} ({cpu}) failed:\n"
                        f"{(r.stderr or r.stdout)[-4000:]}")  # fmt: skip
    sys.stdout.write(r.stdout)
    built = sorted(Path(out_dir).glob(f"{module}.*{GNU[arch]}.so"))
    if not built:
        raise PackError(f"the cross build for {arch} produced no {module} module")
    return built[-1]


def retarget_process(arch: str, cpu: str, features: str) -> None:
    """Make this process's LLVM host ``arch``/``cpu``/``features``, and pycc's toolchain
    the cross compiler: before numba is imported."""
    if "numba" in sys.modules:
        raise RuntimeError("numba is loaded already: the retargeting must come first")
    import llvmlite.binding as ll

    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()

    class Features(dict):  # what get_host_cpu_features returns: flatten() -> the string
        def flatten(self, sort: bool = True) -> str:
            return features

    ll.get_process_triple = lambda: TRIPLES[arch]
    ll.get_host_cpu_name = lambda: cpu
    ll.get_host_cpu_features = lambda: Features()

    from numba.pycc import platform as pycc_platform

    base_init = pycc_platform.Toolchain.__init__
    py_include = os.environ["EDGEPACK_CROSS_INCLUDE"].split(os.pathsep)
    numpy_include = os.environ["EDGEPACK_CROSS_NUMPY_INCLUDE"]

    def init(self) -> None:  # the target's headers, and no host libpython to link
        base_init(self)
        self._py_include_dirs = py_include
        self._math_info = {"include_dirs": [numpy_include], "library_dirs": [],
                           "libraries": []}  # fmt: skip
        self._py_lib_dirs = []

    pycc_platform.Toolchain.__init__ = init
    pycc_platform.Toolchain.get_python_libraries = lambda self: []
    suffix = f".cpython-{PYTHON[0]}{PYTHON[1]}-{GNU[arch]}.so"
    pycc_platform.Toolchain.get_ext_filename = lambda self, name: name + suffix
