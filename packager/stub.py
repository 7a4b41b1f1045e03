"""Device runtime stubs: freeze, inspect, and check them against a target.

A stub is one file: a POSIX sh launcher followed by a gzip'd tar of a PyInstaller
"onedir" build of the device runtime (runtime/ + kernels/ with the kernels compiled
ahead of time; no numba, LLVM, onnx or packager). For another architecture's target
(aarch64 on x86_64) the runtime is assembled from that architecture's CPython and
wheels instead (packager/stub_cross.py); the launcher and the checks are the same.
On its first start the launcher unpacks the runtime once into the user's cache
folder; every later start execs it directly. docs/executable.md gives the
measurements behind this layout.

The launcher's second line carries the stub's metadata as JSON so the packager can
check a stub (architecture, glibc symbol versions) without running it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .. import __version__
from ..kernels.cpu.aot_cache import BUILD_INFO
from ..targets import Target, cpuinfo_flags
from .aot import ensure_kernel_builds, host_arch, kernel_modules
from .ir import PackError

STUB_FORMAT = 1
META_PREFIX = "# edgepack-stub: "
RUNTIME_NAME = "edgepack-rt"
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm"}

# Modules a device never needs; excluding them keeps numba/LLVM, onnx and the
# packager out of the frozen runtime even when installed next to it.
EXCLUDES = [
    "numba",
    "llvmlite",
    "onnx",
    "onnxruntime",
    "edgepack.packager",
    "scipy",
    "matplotlib",
    "tkinter",
    "torch",
    "sklearn",
    "pandas",
    "IPython",
    "PIL",
    "setuptools",
    "pytest",
    "safetensors",
    "pydoc",
    "unittest",
    "lib2to3",
    "pyelftools",
    "elftools",
    "yaml",
    "charset_normalizer",
    "requests",
    "urllib3",
    "readline",
    "curses",
    "sqlite3",
    "bz2",
    "lzma",
    "xmlrpc",
    "pkg_resources",
    "distutils",
]
# Libraries every glibc system has; the board's own copies match its glibc, while
# bundling the build machine's would raise the glibc the stub needs (libstdc++ from
# Debian 12 needs 2.36) - the same policy as manylinux wheels.
SYSTEM_LIBS = ("libstdc++.so.6", "libgcc_s.so.1")

LAUNCHER = r"""#!/bin/sh
{meta_line}
# edgepack device executable: the runtime (unpacked once into the cache folder) plus
# the model bundle appended to this file. Cache: $EDGEPACK_CACHE_DIR, else
# $XDG_CACHE_HOME/edgepack, else $HOME/.cache/edgepack, else ${{TMPDIR:-/tmp}}/edgepack-UID.
set -u
case "$0" in */*) self=$0 ;; *) self=$(command -v -- "$0") ;; esac
if [ -n "${{EDGEPACK_CACHE_DIR:-}}" ]; then base=$EDGEPACK_CACHE_DIR
elif [ -n "${{XDG_CACHE_HOME:-}}" ]; then base=$XDG_CACHE_HOME/edgepack
elif [ -n "${{HOME:-}}" ]; then base=$HOME/.cache/edgepack
else base=${{TMPDIR:-/tmp}}/edgepack-$(id -u); fi
rt=$base/rt/{stub_id}
if [ ! -x "$rt/{runtime}" ]; then
  mkdir -p "$base/rt" && chmod 700 "$base" || exit 1
  tmp=$(mktemp -d "$base/rt/.unpack.XXXXXX") || exit 1
  if ! tail -c +{archive_start} "$self" | head -c {archive_size} | gzip -dc |
      tar -xf - -C "$tmp"; then
    rm -rf "$tmp"; echo "edgepack: cannot unpack the runtime into $base" >&2; exit 1
  fi
  mv "$tmp" "$rt" 2>/dev/null || rm -rf "$tmp"  # another start won the race: use its copy
fi
EDGEPACK_SELF=$self exec "$rt/{runtime}" "$@"
"""


# The cupy wheel per CUDA major version on the device (JetPack 6: CUDA 12.x, JetPack 5:
# CUDA 11.4). cupy-cudaNNx wheels link against the CUDA runtime the board's JetPack
# installs, so the stub carries cupy but not CUDA itself.
CUPY_WHEELS = {12: "cupy-cuda12x", 11: "cupy-cuda11x"}
# numba/llvmlite stay out of cpu stubs (their kernels are compiled ahead of time); the
# cuda kernels are compiled on the device by numba.cuda (with the board's NVVM), so a
# cuda stub keeps them.
CUDA_NEEDS = ("numba", "llvmlite")


# What uvicorn imports by name at run time (its "auto" loop and protocol choices, the
# lifespan and logging configuration), out of reach of PyInstaller's import scan.
UVICORN_BY_NAME = ("uvicorn.logging", "uvicorn.loops.auto", "uvicorn.loops.asyncio",
                   "uvicorn.protocols.http.auto", "uvicorn.protocols.http.h11_impl",
                   "uvicorn.protocols.websockets.auto", "uvicorn.lifespan.off",
                   "uvicorn.lifespan.on")  # fmt: skip


def cuda_packages(target: Target) -> list[str]:
    """The distributions the cuda path adds to a stub for ``target`` ([] without cuda)."""
    if target.cuda is None or "cuda" not in target.backends:
        return []
    major = int(target.cuda.cuda_version.split(".")[0])
    if major not in CUPY_WHEELS:
        raise PackError(
            f"target {target.name}: no cupy wheel known for CUDA {target.cuda.cuda_version} "
            f"(known: {', '.join(f'CUDA {k}.x: {v}' for k, v in CUPY_WHEELS.items())})"
        )
    return [CUPY_WHEELS[major], *CUDA_NEEDS]


def stub_modules(target: Target) -> tuple[list[str], list[str]]:
    """(hidden imports, excluded modules) for freezing ``target``'s runtime."""
    hidden = [
        *(m for _, m in kernel_modules(target)),
        "edgepack_stub_info",
        "edgepack.kernels.cpu.backend",
        "edgepack.kernels.ref.backend",
        "edgepack.kernels.cuda.backend",  # registers names only; safe without a GPU
    ]
    excludes = list(EXCLUDES)
    if cuda_packages(target):
        hidden += [
            "edgepack.kernels.cuda.device",
            "edgepack.kernels.cuda.kernels",
            "numba.cuda",
            "cupy",
            "cupyx",
        ]
        excludes = [m for m in excludes if m not in CUDA_NEEDS]
    return hidden, excludes


def check_cuda_packages(target: Target) -> None:
    """Refuse to freeze a cuda target's stub without the cupy wheel it needs installed."""
    from importlib import metadata

    for dist in cuda_packages(target):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            raise PackError(
                f"target {target.name} runs cuda kernels, so its stub carries {dist}: "
                f"`pip install {dist}` on this build machine (the board itself for a "
                "Jetson, see docs/targets.md) and build again"
            ) from None


def stub_cache_dir() -> Path:
    base = os.environ.get("EDGEPACK_STUB_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "edgepack" / "stubs"


def cached_stub(target: Target) -> Path:
    return stub_cache_dir() / f"{target.name}-{__version__}" / "stub"


def how_to_build(target: Target) -> str:
    where = (
        "this machine"
        if host_arch() == target.arch
        else f"this machine (the first time it makes the arm64 sysroot and cross compiler) "
        f"or an {target.arch} one (the board itself or an arm64 CI runner: "
        ".github/workflows/stubs.yml)"
    )
    return (
        f"build it on {where} with `edgepack stub --target {target.name}` "
        f"(it lands in {cached_stub(target).parent}), or pass one with --stub PATH"
    )


# --- ELF inspection -------------------------------------------------------------------


def elf_facts(data: bytes) -> tuple[str, tuple[int, int]]:
    """(architecture, newest GLIBC_x.y symbol version it needs) of one ELF file."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    elf = ELFFile(io.BytesIO(data))
    arch = ELF_MACHINES.get(
        elf.header["e_machine"]
        if isinstance(elf.header["e_machine"], int)
        else _machine_number(elf.header["e_machine"]),
        "unknown",
    )
    newest = (0, 0)
    for sec in elf.iter_sections():
        if isinstance(sec, GNUVerNeedSection):
            for _, auxs in sec.iter_versions():
                for aux in auxs:
                    m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", aux.name)
                    if m:
                        newest = max(newest, (int(m[1]), int(m[2])))
    return arch, newest


def _machine_number(name: str) -> int:
    return {"EM_X86_64": 62, "EM_AARCH64": 183, "EM_ARM": 40}.get(name, -1)


def scan_elves(files: dict[str, bytes]) -> dict:
    """Architectures and the newest glibc needed over a set of files (non-ELF skipped)."""
    arches: set[str] = set()
    newest, newest_file = (0, 0), ""
    for name, data in files.items():
        if data[:4] != b"\x7fELF":
            continue
        arch, need = elf_facts(data)
        arches.add(arch)
        if need > newest:
            newest, newest_file = need, name
    return {
        "arches": sorted(arches),
        "glibc": f"{newest[0]}.{newest[1]}",
        "glibc_file": newest_file,
    }


# --- reading and checking a stub ------------------------------------------------------


def read_stub(path: str | Path) -> tuple[dict, bytes]:
    """(metadata, runtime archive bytes) of a stub file, or PackError."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise PackError(f"--stub {p}: cannot read: {e}") from None
    head = data[:8192].split(b"\n")
    if len(head) < 2 or not head[1].startswith(META_PREFIX.encode()):
        raise PackError(f"{p} is not an edgepack runtime stub (no stub metadata line)")
    try:
        meta = json.loads(head[1][len(META_PREFIX) :])
        start, size = meta["archive_start"], meta["archive_size"]
    except (ValueError, KeyError) as e:
        raise PackError(f"{p}: corrupt stub metadata ({e})") from None
    archive = data[start - 1 : start - 1 + size]
    if len(archive) != size or hashlib.sha256(archive).hexdigest()[:16] != meta["stub_id"]:
        raise PackError(f"{p}: stub is truncated or corrupt (archive checksum mismatch)")
    return meta, archive


def archive_files(archive: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                f = tar.extractfile(m)
                if f is not None:
                    out[m.name] = f.read()
    return out


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def runtime_sources_digest() -> str:
    """sha256 (16 hex digits) of the device-side sources a stub freezes (runtime/ and
    kernels/). The stub cache is keyed by version only, and a stub frozen from other
    sources may lack kernels that this packager plans for (it would fail at load)."""
    h = hashlib.sha256()
    for rel, f in _device_sources():
        h.update(f"{rel}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _device_sources() -> list[tuple[str, Path]]:
    """(path under edgepack/, file) of every source of the device runtime: runtime/ and
    kernels/ with their subpackages (runtime/serve, kernels/cpu...), sorted."""
    from .. import kernels, runtime

    out = []
    for mod in (runtime, kernels):
        root = Path(mod.__file__).parent
        pkg = mod.__name__.rsplit(".", 1)[1]
        for f in root.rglob("*.py"):
            if "__pycache__" not in f.parts:
                out.append((f"{pkg}/{f.relative_to(root).as_posix()}", f))
    return sorted(out)


def check_stub(path: str | Path, target: Target) -> dict:
    """Refuse a stub the target cannot run; returns its metadata."""
    meta, archive = read_stub(path)
    facts = scan_elves(archive_files(archive))  # the files themselves, not just the label
    arches = set(facts["arches"]) | {meta.get("arch")}
    if arches != {target.arch}:
        raise PackError(
            f"stub {path} is built for {', '.join(sorted(a for a in arches if a))}, but target "
            f"{target.name} is {target.arch}; {how_to_build(target)}"
        )
    if _vtuple(facts["glibc"]) > _vtuple(target.min_glibc):
        raise PackError(
            f"stub {path} needs glibc {facts['glibc']} (symbol versions in "
            f"{facts['glibc_file']}), but target {target.name} guarantees only glibc "
            f"{target.min_glibc}: build the stub on a system with glibc <= {target.min_glibc} "
            "(e.g. in the board's own OS image or an older distribution container)"
        )
    want = runtime_sources_digest()
    if meta.get("sources") != want:
        raise PackError(
            f"stub {path} was frozen from other edgepack runtime sources "
            f"({meta.get('sources') or 'not recorded'}; this edgepack's are {want}), so its "
            f"kernels may not match what this packager plans; rebuild it: {how_to_build(target)}"
        )
    return meta


# --- freezing a stub --------------------------------------------------------------------


def _deterministic_targz(root: Path) -> bytes:
    """gzip'd tar of ``root``'s contents, byte-identical for identical inputs."""
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if info.isfile():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def _launcher(meta: dict, archive: bytes) -> bytes:
    """The sh launcher; the archive starts right after it (its offset is in the text,
    so iterate until the length stops changing)."""
    meta = dict(meta, archive_size=len(archive), archive_start=0)
    while True:
        text = LAUNCHER.format(
            meta_line=META_PREFIX + json.dumps(meta, sort_keys=True),
            stub_id=meta["stub_id"],
            runtime=RUNTIME_NAME,
            archive_start=meta["archive_start"],
            archive_size=len(archive),
        )
        start = len(text.encode()) + 1  # `tail -c +N` counts from 1
        if start == meta["archive_start"]:
            return text.encode()
        meta["archive_start"] = start


def _strip(root: Path, log: Callable[[str], None], arch: str | None = None) -> None:
    """strip --strip-unneeded the Python extension modules and libpython (safe), but not
    the vendored OpenBLAS/gfortran libraries, which stop loading when stripped. Another
    architecture's files take its cross strip."""
    env = None
    if arch is None or arch == host_arch():
        tool = ["strip"] if shutil.which("strip") else None
    else:
        from .aot_cross import toolchain  # the cross binutils, as the kernels' build

        cross = toolchain(arch)
        tool, env = [cross["STRIP"]], dict(os.environ, **cross)
    if tool is None:
        log("      strip not found: skipping")
        return
    for f in root.rglob("*.so*"):
        if f.is_file() and "scipy_openblas" not in f.name and "gfortran" not in f.name:
            subprocess.run([*tool, "--strip-unneeded", str(f)], check=False,
                           capture_output=True, env=env)  # fmt: skip


def _stage_runtime_sources(dst: Path) -> Path:
    """Copy the device-side packages into a plain ``edgepack/`` tree for PyInstaller.

    PyInstaller's import analysis does not follow setuptools' editable-install
    mapping, and staging only runtime/ and kernels/ also keeps the packager out."""
    import edgepack

    pkg = dst / "edgepack"
    pkg.mkdir(parents=True)
    shutil.copy(Path(edgepack.__file__), pkg / "__init__.py")
    for rel, f in _device_sources():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, pkg / rel)
    return dst


def build_stub(target: Target, out: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Freeze the device runtime for ``target`` on this machine; returns the stub path.
    For another architecture (aarch64 on x86_64) the runtime is assembled from that
    architecture's Python and wheels instead (packager/stub_cross.py)."""
    cross = host_arch() != target.arch
    if cross:
        from .aot_cross import ensure_toolchain
        from .stub_cross import check_target

        check_target(target)
        ensure_toolchain(target.arch, log)  # made here the first time (~400 MB, once)
    else:
        check_cuda_packages(target)
        import importlib.util

        if importlib.util.find_spec("PyInstaller") is None:
            raise PackError(
                "freezing a runtime stub needs PyInstaller: pip install 'edgepack[stub]'"
            )
    out = out or cached_stub(target)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgepack-stub-") as tmp:
        work = Path(tmp)
        aot = work / "aot"
        aot.mkdir()
        log(f"[1/4] kernels for {', '.join(b.cpu for b in target.kernel_builds)} ({target.arch})")
        builds = []
        for b, m, folder in ensure_kernel_builds(target, log):
            info = json.loads((folder / BUILD_INFO).read_text())
            shutil.copy(folder / info["file"], aot / info["file"])
            builds.append((b, m))
        info = {
            "target": target.name,
            "arch": target.arch,
            "cpu": target.cpu,
            "edgepack": __version__,
            "default_threads": target.default_threads,  # the kernel pool's cap
            # the kernel builds, first preferred: the runtime takes the first whose
            # /proc/cpuinfo flags the CPU has (kernels/cpu/native.py)
            "kernels": [
                {"module": m, "cpu": b.cpu, "flags": cpuinfo_flags(target.arch, b.cpu_features)}
                for b, m in builds
            ],
        }
        (aot / "edgepack_stub_info.py").write_text(f"INFO = {info!r}\n")
        root = work / "dist" / RUNTIME_NAME
        python = platform.python_version()
        if cross:
            log(f"[2/4] assemble the {target.arch} runtime (Debian's python3.11, aarch64 wheels)")
            from .stub_cross import runtime_tree

            kernels = [f for f in aot.iterdir() if f.suffix == ".so"]
            python = runtime_tree(root, target, kernels, f"INFO = {info!r}\n",
                                  _stage_runtime_sources, cuda_packages(target),
                                  log)["python"]  # fmt: skip
        else:
            _freeze(work, aot, target, log)
        log("[3/4] shrink and inspect")
        for lib in SYSTEM_LIBS:
            for f in root.rglob(lib):
                f.unlink()
        _strip(root, log, target.arch)
        files = {
            str(p.relative_to(root)): p.read_bytes()
            for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()
        }
        facts = scan_elves(files)
        archive = _deterministic_targz(root)
        unpacked = sum(len(b) for b in files.values())
        meta = {
            "format": STUB_FORMAT,
            "target": target.name,
            "arch": target.arch,
            "cpu": target.cpu,
            "edgepack": __version__,
            "python": python,
            "glibc": facts["glibc"],
            "glibc_file": facts["glibc_file"],
            "unpacked_bytes": unpacked,
            "stub_id": hashlib.sha256(archive).hexdigest()[:16],
            "sources": runtime_sources_digest(),
        }
        log("[4/4] write the stub")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_bytes(_launcher(meta, archive) + archive)
        tmp_out.chmod(0o755)
        os.replace(tmp_out, out)
        (out.parent / "stub.json").write_text(json.dumps(read_stub(out)[0], indent=2) + "\n")
    log(
        f"      {out}: {out.stat().st_size / 1e6:.1f} MB ({unpacked / 1e6:.1f} MB unpacked), "
        f"needs glibc {facts['glibc']}; {time.perf_counter() - t0:.0f}s"
    )
    return out


def _freeze(work: Path, aot: Path, target: Target, log: Callable[[str], None]) -> None:
    """PyInstaller's onedir build of the runtime into work/dist/edgepack-rt."""
    src = _stage_runtime_sources(work / "src")
    entry = work / "entry.py"
    entry.write_text(
        "import sys\nfrom edgepack.runtime.stub_main import main\nsys.exit(main())\n"
    )
    log("[2/4] freeze the runtime with PyInstaller (onedir)")
    cmd = [
        sys.executable,
        "-m",
        "PyInstaller",
        "--onedir",
        "--noconfirm",
        "--clean",
        "--log-level",
        "WARN",
        "--name",
        RUNTIME_NAME,
        "--distpath",
        str(work / "dist"),
        "--workpath",
        str(work / "build"),
        "--specpath",
        str(work),
        "--paths",
        str(src),
        "--paths",
        str(aot),
    ]
    hidden, excludes = stub_modules(target)
    for mod in hidden:
        cmd += ["--hidden-import", mod]
    # nacl's C binding loads through cffi's backend, which the import scan misses;
    # tokenizers and jinja2 are imported lazily by generate (runtime/text.py), the
    # HTTP stack by serve --http, and uvicorn picks its loop and protocol by name
    optional = ("nacl.signing", "_cffi_backend", "paho.mqtt.client", "threadpoolctl",
                "tokenizers", "jinja2", "jinja2.sandbox", "edgepack.runtime.serve.http",
                "fastapi", "uvicorn", *UVICORN_BY_NAME)  # fmt: skip
    for mod in optional:
        try:
            __import__(mod)
            cmd += ["--hidden-import", mod]
        except ImportError:
            log(f"      {mod} not installed: the stub will lack it")
    for mod in excludes:
        cmd += ["--exclude-module", mod]
    r = subprocess.run(cmd + [str(entry)], capture_output=True, text=True)
    if r.returncode:
        raise PackError(f"PyInstaller failed:\n{r.stderr[-4000:]}")
