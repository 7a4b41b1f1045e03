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
