"""Ahead-of-time kernel builds kept for the development install (and for stub builds).

A device executable carries its kernels compiled ahead of time (packager/aot.py); the
development install used to compile them with numba's JIT on first use instead, 36-84 s
on a new machine before the digits demo printed anything. The same AOT builds, made
once at install (setup.py) or by ``edgepack kernels``, are kept here:

    <cache_dir>/kernels/<machine>-<python tag>-<sources digest>/<module>-<cpu>/
        <module>.cpython-*.so   build.json

The folder is named by a digest of the kernel sources (the files under kernels/), so
an edited kernel never runs from a stale build: the runtime finds no folder for the
new digest and takes the JIT until the builds are made again. ``build.json`` records
the CPU features the build needs as /proc/cpuinfo names them; the runtime takes the
build with the most of them that this CPU has (packager/stub.py copies the same
builds into executables, kernels/cpu/native.py picks among those the same way).

This module is on the device side: it reads files and imports one extension, nothing
else (no numba, no packager).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import platform
import sys
from pathlib import Path

from ... import cache_dir

# Bump when packager/aot.py changes how the sources become code (flags, features, the
# exports' signatures live in abi.py, which the digest covers): builds made the old
# way are then not taken.
AOT_CACHE_FORMAT = 1
BUILD_INFO = "build.json"


def kernel_sources_digest(root: Path | None = None) -> str:
    """sha256 (16 hex digits) of the kernel sources a CPU build is made from (the files
    directly in kernels/ and this package's, kernels/cpu/; the other backends' folders
    are never imported by it, and editing them keeps the builds) and the cache format:
    the key of the builds made from them. ~2 ms for 0.8 MB."""
    here = Path(__file__).resolve().parent
    root = root or here.parent
    h = hashlib.sha256(f"aot-cache {AOT_CACHE_FORMAT}\0".encode())
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if "__pycache__" not in rel and (len(rel) == 1 or rel[0] == here.name):
            h.update(f"{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def builds_dir(digest: str | None = None, machine: str | None = None) -> Path:
    """The folder of the builds made from these kernel sources, for this Python and
    ``machine`` (default: this one's; aarch64 for the cross builds of an ARM stub)."""
    tag = f"{machine or platform.machine()}-{sys.implementation.cache_tag}"
    return cache_dir() / "kernels" / f"{tag}-{digest or kernel_sources_digest()}"


def cached_builds(where: Path | None = None) -> list[dict]:
    """build.json of every complete build in ``where`` (default: this source's folder),
    with ``path`` (the extension file) added; most required features first."""
    where = where or builds_dir()
    out = []
    for info in sorted(where.glob(f"*/{BUILD_INFO}")) if where.is_dir() else []:
        try:
            b = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        path = info.parent / b.get("file", "")
        if b.get("file") and path.is_file():
            out.append({**b, "path": str(path)})
    return sorted(out, key=lambda b: -len(b.get("flags", ())))


def import_build(build: dict):
    """The extension module of a cached build (imported under its own module name:
    pycc names its init function after it)."""
    loader = importlib.machinery.ExtensionFileLoader(build["module"], build["path"])
    spec = importlib.util.spec_from_file_location(build["module"], build["path"], loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
