"""The device runtime of an aarch64 stub, assembled on an x86_64 workstation.

PyInstaller freezes only for the machine it runs on, so an ARM stub's runtime is put
together from parts that exist for aarch64 already, each from a package registry:

- CPython: Debian bookworm's arm64 ``python3.11`` (libpython linked in) and its
  standard library, from the sysroot of ``aarch64_sysroot.sh`` (aot_cross.py), with the few
  shared libraries it and its extension modules load (zlib, libffi, OpenSSL);
- packages: the aarch64 wheels of the runtime's dependencies at the versions this
  workstation runs (so the stub runs the code the tests ran), from PyPI;
- edgepack: the device-side sources (runtime/, kernels/) and the kernels compiled
  ahead of time for the target on this machine (packager/aot_cross.py).

The tree (``runtime_tree``):

    edgepack-rt                    sh: LD_LIBRARY_PATH=lib, exec bin/python3.11 -I -S entry.py
    entry.py                       sys.path, sys.frozen, then runtime.stub_main.main()
    bin/python3.11
    lib/*.so.*                     zlib, libffi, OpenSSL
    lib/python3.11/                the standard library, lib-dynload
    lib/python3.11/site-packages/  wheels (tests pruned), edgepack, edgepack_kernels*.so,
                                   edgepack_stub_info.py
                                   (Python files as .pyc only, as PyInstaller ships them)

``-I -S``: no environment variables, user site or Debian's site folders reach it; the
interpreter finds its standard library from its own location (``lib/python3.11/os.pyc``
beside ``bin/``). The C library, libstdc++, libgcc_s and libexpat are the board's (every
Raspberry Pi OS and JetPack image has them; JetPack 6's glibc 2.35 could not load
bookworm's libexpat, which needs 2.36).

``EDGEPACK_EMULATOR`` (e.g. ``qemu-aarch64-static``), when set, goes in front of the
interpreter: an x86_64 machine without binfmt_misc runs the executable that way
(tests/test_stub_aarch64.py).
"""

from __future__ import annotations

import compileall
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from .. import cache_dir
from .aot_cross import GNU, PYTHON, sysroot
from .ir import PackError

PY = f"python{PYTHON[0]}.{PYTHON[1]}"
# The newest glibc the assembled runtime needs: Debian bookworm's python3.11 calls
# hypot@GLIBC_2.35 (the wheels need <= 2.28, the kernels 2.34). Raspberry Pi OS
# bookworm (2.36) and JetPack 6 (2.35) have it; JetPack 5 (2.31) does not, and no
# registry has an aarch64 CPython built for an older glibc.
RUNTIME_GLIBC = (2, 35)
# What the device runtime imports (pyproject's dependencies and the llm extra), pinned
# to this machine's versions with everything they require.
RUNTIME_DISTS = ("numpy", "threadpoolctl", "pynacl", "paho-mqtt", "fastapi", "uvicorn",
                 "tokenizers", "jinja2")  # fmt: skip
# Requirements a device never uses: the hub client (tokenizers' from_pretrained; a
# bundle carries its tokenizer) and what only it needs.
NOT_ON_DEVICE = frozenset({"huggingface-hub"})
# A cuda target's stub also carries cupy for its CUDA (packager/stub.py cuda_packages),
# which this workstation need not have installed: its pins are kept here (and with
# them what they require); numba and llvmlite, the rest of that path, come at this
# machine's versions like everything else.
CUDA_PINS = {"cupy-cuda12x": {"cupy-cuda12x": "14.2.0", "cuda-pathfinder": "1.9.1"}}
# The board's own (module doc); the rest of what python3.11 and its modules load ships.
SHIPPED_LIBS = ("libz.so.1", "libffi.so.8", "libssl.so.3", "libcrypto.so.3")
# Standard-library folders and modules a device never imports (PyInstaller's excludes
# in packager/stub.py, plus the test suites and tools; not unittest, which numba.cuda
# imports).
STDLIB_DROP = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
               "distutils", "pydoc_data", "sqlite3", "curses", "dbm",
               "xmlrpc", "venv", "config-3.11-aarch64-linux-gnu", "__pycache__",
               "site-packages", "dist-packages")  # fmt: skip
# In the wheels: test suites, numpy's build tools and test extensions, type stubs. The
# device runtime imports none of them (PyInstaller's import scan leaves them out too).
# Not "testing" folders: cupy's __init__ looks its own up.
SITE_DROP_DIRS = ("tests", "f2py", "distutils", "_pyinstaller")
SITE_DROP_FILES = re.compile(r".*\.pyi$|^py\.typed$|^_\w+_tests\.cpython.*\.so$|^_simd\.cpython")
DYNLOAD_DROP = re.compile(r"^_(test|xx|ctypes_test|curses|sqlite3|dbm|gdbm|tkinter)|"
                          r"^(xxlimited|readline|nis|ossaudiodev|audioop)")  # fmt: skip

WRAPPER = """#!/bin/sh
# edgepack runtime for {arch}: Debian's python3.11 with this folder's libraries
d=$(dirname "$0")
LD_LIBRARY_PATH="$d/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec \\
  ${{EDGEPACK_EMULATOR:-}} "$d/bin/{py}" -I -S "$d/entry.py" "$@"
"""
ENTRY = """\
# The device runtime's entry (packager/stub_cross.py): the interpreter runs with -I -S,
# so the packages' folder is put on the path here.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", {py!r},
                                "site-packages"))
sys.frozen = True  # a stub: its own kernel builds, no numba cache to check
sys.dont_write_bytecode = True  # the .pyc are shipped; the cache folder may be read-only
from edgepack.runtime.stub_main import main

sys.exit(main())
"""


def pinned_closure(names: tuple[str, ...] = RUNTIME_DISTS) -> dict[str, str]:
    """{distribution: version} of ``names`` and all they require on an aarch64 Linux
    CPython 3.11 (markers evaluated for it, no extras), at this machine's versions."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = dict(default_environment(), python_version=f"{PYTHON[0]}.{PYTHON[1]}",
               python_full_version=f"{PYTHON[0]}.{PYTHON[1]}.0", platform_machine="aarch64",
               sys_platform="linux", platform_system="Linux", extra="")  # fmt: skip
    out: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in out or name in NOT_ON_DEVICE:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise PackError(f"the runtime needs {name}, which is not installed here: "
                            f"pip install {name}") from None  # fmt: skip
        out[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(out.items()))


def fetch_wheels(pins: dict[str, str], dest: Path, log: Callable[[str], None]) -> list[Path]:
    """The aarch64 (or pure) wheel of every pin, downloaded into ``dest`` once."""
    dest.mkdir(parents=True, exist_ok=True)
    want = [_norm(f"{n}=={v}") for n, v in pins.items()]
    missing = [w for w in want if w not in _wheels_in(dest)]
    if missing:
        log(f"      pip download {len(missing)} aarch64 wheels into {dest}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--dest", str(dest),
               "--only-binary=:all:", "--no-deps", "--implementation", "cp",
               "--python-version", f"{PYTHON[0]}{PYTHON[1]}",
               "--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_17_aarch64",
               "--platform", "manylinux_2_28_aarch64", "--platform", "any", *missing]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise PackError(f"cannot download the aarch64 wheels {', '.join(missing)}:\n"
                            f"{r.stderr[-2000:]}")  # fmt: skip
    have = _wheels_in(dest)
    return [have[w] for w in want]


def _wheels_in(folder: Path) -> dict[str, Path]:
    """{normalised name==version: wheel file} of the wheels in ``folder``."""
    return {_norm("==".join(p.name.split("-")[:2])): p for p in folder.glob("*.whl")}


def _norm(pin: str) -> str:
    name, _, ver = pin.partition("==")
    return re.sub(r"[-_.]+", "-", name).lower() + "==" + ver


def unpack_wheel(whl: Path, site: Path) -> None:
    """Lay a wheel's files out as pip would (its .data/purelib and platlib merged)."""
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    for data in site.glob("*.data"):
        for sub in ("purelib", "platlib"):
            if (data / sub).is_dir():
                shutil.copytree(data / sub, site, dirs_exist_ok=True)
        shutil.rmtree(data)


def _copy_stdlib(src: Path, dst: Path) -> None:
    def ignore(folder: str, names: list[str]) -> list[str]:
        if Path(folder).name == "lib-dynload":
            return [n for n in names if DYNLOAD_DROP.match(n)]
        return [n for n in names if n in STDLIB_DROP or n.endswith((".pyc", ".exe"))]

    shutil.copytree(src, dst, ignore=ignore, symlinks=False)


def check_target(target) -> None:
    """Refuse a target this route cannot serve, before anything is built."""
    if target.arch not in GNU:
        raise PackError(f"no cross-assembled runtime for {target.arch} (known: {', '.join(GNU)})")
    have = tuple(int(x) for x in target.min_glibc.split(".")[:2])
    if have < RUNTIME_GLIBC:
        need = ".".join(map(str, RUNTIME_GLIBC))
        raise PackError(
            f"target {target.name} guarantees glibc {target.min_glibc}, but the runtime "
            f"assembled on this machine needs {need} (Debian bookworm's python3.11): build "
            f"this target's stub on the board itself (`edgepack stub --target {target.name}`"
            " there) and pass it with --stub"
        )


def runtime_tree(root: Path, target, kernels: list[Path], stub_info: str,
                 stage_sources: Callable[[Path], Path], cuda: list[str],
                 log: Callable[[str], None]) -> dict:  # fmt: skip
    """Assemble the runtime for ``target`` (an aarch64 target) in ``root`` (module doc);
    returns {"python": version}. ``kernels``: the extension files to ship;
    ``stage_sources(dst)`` copies edgepack's device sources into ``dst/edgepack``;
    ``cuda``: the distributions a cuda target's stub adds (stub.cuda_packages). The
    caller has checked the target (``check_target``)."""
    sr = sysroot()
    gnu = GNU[target.arch]
    python = sr / "usr/bin" / PY
    if not python.is_file():
        raise PackError(f"no arm64 {PY} in {sr}: make it with `bash scripts/aarch64_sysroot.sh`")
    (root / "bin").mkdir(parents=True)
    shutil.copy(python, root / "bin" / PY)
    libs = root / "lib"
    libs.mkdir()
    for name in SHIPPED_LIBS:
        found = [p for d in ("lib", "usr/lib") if (p := sr / d / gnu / name).exists()]
        if not found:
            raise PackError(f"{name} is missing from {sr}: run scripts/aarch64_sysroot.sh again")
        shutil.copy(found[0].resolve(), libs / name)
    stdlib = libs / PY
    _copy_stdlib(sr / "usr/lib" / PY, stdlib)
    site = stdlib / "site-packages"
    site.mkdir()
    for dist in cuda:
        if dist not in CUDA_PINS and "cupy" in dist:
            raise PackError(f"target {target.name} needs {dist}, for which no aarch64 stub "
                            f"is assembled here (known: {', '.join(CUDA_PINS)})")  # fmt: skip
    pins = pinned_closure(RUNTIME_DISTS + tuple(d for d in cuda if d not in CUDA_PINS))
    for dist in cuda:
        pins.update(CUDA_PINS.get(dist, {}))
    wheels = fetch_wheels(pins, cache_dir() / "wheels" / f"{target.arch}-cp{PYTHON[0]}{PYTHON[1]}",
                          log)  # fmt: skip
    for whl in wheels:
        unpack_wheel(whl, site)
    log(f"      {len(wheels)} wheels: {', '.join(f'{n} {v}' for n, v in pins.items())}")
    stage_sources(site)
    for k in kernels:
        shutil.copy(k, site / k.name)
    (site / "edgepack_stub_info.py").write_text(stub_info)
    (root / "entry.py").write_text(ENTRY.format(py=PY))
    wrapper = root / "edgepack-rt"
    wrapper.write_text(WRAPPER.format(arch=target.arch, py=PY))
    wrapper.chmod(0o755)
    _prune(site)
    # bytecode for the interpreter's own version (its magic number is per minor
    # version; toolchain() checked this machine runs the same 3.11) in place of the
    # sources, as PyInstaller ships it: 29 MB of .py fewer, and nothing to compile or
    # check against timestamps (which the archive does not keep) at start-up
    if not compileall.compile_dir(str(stdlib), quiet=2, legacy=True, workers=1):
        raise PackError(f"compiling the runtime's Python files in {stdlib} failed")
    for f in stdlib.rglob("*.py"):
        f.unlink()
    for d in sorted(stdlib.rglob("__pycache__"), reverse=True):
        shutil.rmtree(d, ignore_errors=True)
    return {"python": _debian_python_version(sr)}


def _prune(site: Path) -> None:
    for d in sorted(site.rglob("*"), reverse=True):  # deepest first
        if d.is_dir() and d.name in SITE_DROP_DIRS and d.parent != site:
            shutil.rmtree(d)
        elif d.is_file() and SITE_DROP_FILES.match(d.name):
            d.unlink()


def _debian_python_version(sr: Path) -> str:
    """The sysroot python's version (3.11.2), from its Debian changelog's first line:
    it is another architecture's program, not run here."""
    import gzip

    log = sr / "usr/share/doc" / f"{PY}-minimal" / "changelog.Debian.gz"
    try:
        m = re.match(rf"{PY} \((\d+\.\d+\.\d+)", gzip.open(log, "rt").readline())
    except OSError:
        m = None
    return m[1] if m else f"{PYTHON[0]}.{PYTHON[1]}"
