"""Compile the CPU kernels ahead of time into the ``edgepack_kernels`` extension.

numba's ``pycc`` turns the same kernel source the JIT uses into a CPython extension
that needs only libc and libm: device executables then run without numba and LLVM
(smaller, and no compile or cache load at start-up). It compiles for the machine it
runs on (``pycc`` cannot cross-compile), tuned for the target's CPU name.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

from ..kernels.cpu.abi import AOT_MODULE, POOLED_SUFFIX, aot_signatures
from .ir import PackError


@contextlib.contextmanager
def _pycc_flags():
    """Every export releases the GIL while it runs (numba's ``nogil``), so a server's
    other threads run during a kernel, and compiles with the JIT kernels' numpy error
    model (kernels/cpu/jit.py: IEEE division, loops LLVM can vectorise; pycc's default
    is Python's, a zero check per division). pycc builds its flags itself and has no
    option for either: its Flags class is swapped for one that sets them, for this build."""
    from numba.pycc import compiler

    from ..kernels.cpu.jit import ERROR_MODEL

    base = compiler.Flags

    class NogilFlags(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.release_gil = True
            self.error_model = ERROR_MODEL

    compiler.Flags = NogilFlags
    try:
        yield
    finally:
        compiler.Flags = base


@contextlib.contextmanager
def _with_features(features: str):
    """pycc's target machine gets the CPU name only (its codegen passes no features):
    ``x86-64-v4`` alone lacks VNNI, and qdot's ``vpdpbusd`` then fails instruction
    selection. The features go to the target machine too, for this build."""
    from numba.core.codegen import AOTCPUCodegen

    base = AOTCPUCodegen._customize_tm_features
    AOTCPUCodegen._customize_tm_features = lambda self: features
    try:
        yield
    finally:
        AOTCPUCodegen._customize_tm_features = base


def compile_kernels(
    out_dir: str | Path,
    cpu_name: str = "host",
    gemm_shape: str | None = None,
    features: str | None = None,
    module: str = AOT_MODULE,
) -> Path:
    """Build ``edgepack_kernels*.so`` into ``out_dir`` for LLVM CPU ``cpu_name`` (which
    implies its features, e.g. ``x86-64-v3`` = AVX2 + FMA) with the GEMM tile shape
    ``gemm_shape`` (default: the host's); returns its path. ``features`` (an LLVM feature
    string, the target's ``llvm_features``; default: the host's for ``host``, none
    else) picks the integer-dot instructions (kernels/cpu/qdot.py), which the CPU name
    alone does not tell the kernel source. ``module``: the extension's name (a target's
    extra builds are more modules beside the first, kernels/cpu/native.py picks one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pycc's pending-deprecation notice
        from numba.pycc import CC

    import importlib

    from numba import types

    from ..kernels.cpu import kernels as cpu_numba
    from ..kernels.cpu.native import gemm_shape as host_gemm_shape
    from ..kernels.cpu.native_pool import launcher, pool_start

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cc = CC(module)
    cc.output_dir = str(out)
    cc.target_cpu = cpu_name
    cc.verbose = False
    shape = gemm_shape or host_gemm_shape()
    state = types.Array(types.int64, 1, "C")  # the kernel pool's (kernels/cpu/pool.py)
    cc.export("pool_start", types.void(state, types.int64))(pool_start.py_func)
    for export, (fn, sig) in aot_signatures(shape).items():
        mod, _, name = fn.rpartition(".")
        where = importlib.import_module(f"{cpu_numba.__package__}.{mod}") if mod else cpu_numba
        kern = getattr(where, name)
        if kern.targetoptions.get("parallel"):  # threads: kernels/cpu/native_pool.py
            cc.export(export + POOLED_SUFFIX, sig.return_type(state, *sig.args))(
                launcher(kern)
            )
        else:
            cc.export(export, sig)(kern.py_func)
    from ..kernels.cpu import qdot

    if features is None and cpu_name == "host":
        from ..kernels.cpu.simd import host_features

        features = ",".join(f"+{f}" for f in sorted(host_features()))
    t = time.perf_counter()
    before, qdot.BUILD_FEATURES[0] = qdot.BUILD_FEATURES[0], features or ""
    try:
        with _pycc_flags(), _with_features(features or ""):
            cc.compile()
    finally:
        qdot.BUILD_FEATURES[0] = before
    built = sorted(out.glob(f"{module}.*so"))
    if not built:
        raise RuntimeError(f"pycc produced no {module} module in {out}")
    isa = qdot.dot_isa({f[1:] for f in (features or "").split(",") if f.startswith("+")})
    print(
        f"compiled {len(aot_signatures(shape))} kernels for {cpu_name} (GEMM tiles {shape}, "
        f"integer dot {isa}) in "
        f"{time.perf_counter() - t:.1f}s -> {built[-1].name}"
    )
    return built[-1]


def host_arch() -> str:
    """This machine's architecture as targets name it (x86_64, aarch64)."""
    import platform

    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def kernel_modules(target) -> list[tuple[object, str]]:
    """(build, extension module name) of each of ``target``'s kernel builds, first
    preferred; the target's own build is ``edgepack_kernels``."""
    *extra, base = target.kernel_builds
    return [(b, f"{AOT_MODULE}_{i}") for i, b in enumerate(extra, 1)] + [(base, AOT_MODULE)]


def _build_key(target, build, module: str) -> tuple[str, str, str]:
    """(folder name, GEMM tile shape, LLVM features) of one build in the cache."""
    import hashlib

    from ..kernels.cpu.native import gemm_shape
    from ..targets import llvm_features

    shape = gemm_shape(set(build.cpu_features), target.arch)
    feats = llvm_features(target.arch, build.cpu_features)
    tag = hashlib.sha256(f"{feats}|{shape}".encode()).hexdigest()[:8]
    return f"{module}-{build.cpu}-{tag}", shape, feats


def _compile_into_cache(where: str, target_arch: str, cpu: str, shape: str, feats: str,
                        module: str, flags: list[str]) -> str:  # fmt: skip
    """Compile one build into a fresh folder beside ``where`` and move it into place
    (another process making the same build at once loses nothing: the first kept)."""
    import json
    import os
    import shutil
    import tempfile

    from ..kernels.cpu.aot_cache import BUILD_INFO

    dest = Path(where)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        t = time.perf_counter()
        if target_arch == host_arch():
            built = compile_kernels(tmp, cpu, shape, feats, module)
        else:  # in a process of its own that targets the other architecture throughout
            from .aot_cross import compile_kernels_cross

            built = compile_kernels_cross(tmp, target_arch, cpu, shape, feats, module)
        info = {"module": module, "cpu": cpu, "arch": target_arch, "flags": flags,
                "gemm_shape": shape, "features": feats, "file": built.name,
                "seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from the install's other users
        try:
            os.rename(tmp, dest)
        except OSError:  # made meanwhile by another process
            if not (dest / BUILD_INFO).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def ensure_kernel_builds(target, log=print) -> list[tuple[object, str, Path]]:
    """(build, module, folder) of every kernel build of ``target``, first preferred,
    compiled into the kernel cache (kernels/cpu/aot_cache.py) where missing, two at a
    time (pycc compiles on one core, ~5 minutes a build). Another architecture's
    builds (aarch64 on x86_64) are cross-compiled (packager/aot_cross.py)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ..kernels.cpu.aot_cache import BUILD_INFO, builds_dir
    from ..targets import cpuinfo_flags

    if target.arch != host_arch():
        from .aot_cross import toolchain

        toolchain(target.arch)  # what a cross build needs, before anything starts
    root = builds_dir(machine=target.arch)
    out, todo = [], []
    for b, module in kernel_modules(target):
        name, shape, feats = _build_key(target, b, module)
        dest = root / name
        out.append((b, module, dest))
        if not (dest / BUILD_INFO).is_file():
            flags = cpuinfo_flags(target.arch, b.cpu_features)
            todo.append((str(dest), target.arch, b.cpu, shape, feats, module, flags))
    if not todo:
        log(f"      kernels for {', '.join(b.cpu for b, _, _ in out)}: cached in {root}")
        return out
    t = time.perf_counter()
    log(f"      compiling {len(todo)} kernel build(s) ({', '.join(j[2] for j in todo)}) "
        f"into {root}: ~5 minutes each, two at a time")  # fmt: skip
    if len(todo) == 1:
        _compile_into_cache(*todo[0])
    else:
        ctx = multiprocessing.get_context("spawn")  # numba's state is not fork-safe
        with ProcessPoolExecutor(max_workers=min(2, len(todo)), mp_context=ctx) as pool:
            for f in [pool.submit(_compile_into_cache, *j) for j in todo]:
                f.result()
    log(f"      kernel builds done in {time.perf_counter() - t:.0f}s")
    return out


def host_target():
    """The shipped target whose kernel builds suit this machine best: of this
    architecture's, the one whose own build this CPU runs and whose builds use the most
    features it has (linux-x86_64 on x86-64)."""
    from ..kernels.cpu.native import host_cpu_flags
    from ..targets import cpuinfo_flags, list_targets

    arch, have = host_arch(), host_cpu_flags()
    fits = []
    for t in list_targets():
        if t.arch != arch:
            continue
        need = set(cpuinfo_flags(t.arch, t.cpu_features))
        if have is None or need <= have:
            usable = max(len(set(cpuinfo_flags(t.arch, b.cpu_features)) & (have or set()))
                         for b in t.kernel_builds)  # fmt: skip
            fits.append((usable, t.name, t))
    if not fits:
        raise PackError(f"no shipped target runs on this {arch} CPU; pass --target")
    return max(fits, key=lambda f: f[:2])[2]


def _cross_main(argv: list[str]) -> int:
    """The process of a cross build (aot_cross.compile_kernels_cross): this one's LLVM
    is made the target's before numba loads, then the build is the host build's."""
    import json

    from .aot_cross import retarget_process

    job = json.loads(argv[0])
    retarget_process(job["arch"], job["cpu"], job["features"])
    compile_kernels(job["out"], job["cpu"], job["shape"], job["features"], job["module"])
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_cross_main(sys.argv[1:]))
