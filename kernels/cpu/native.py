"""Which build of the CPU kernels runs: ahead-of-time compiled, or numba JIT.

``EDGEPACK_KERNELS`` = ``auto`` (default: the AOT kernels when there are some, as in
frozen device executables and in a development install whose kernel builds were made
at install or by ``edgepack kernels``, else JIT), ``aot`` (require them) or ``jit``.
Both builds come from the same source (kernels/cpu/kernels.py) and give bit-identical results.
"""

from __future__ import annotations

import functools
import importlib
import os
import types
from types import SimpleNamespace

import numpy as np

from ..flags import HAS_BIAS, HAS_RES, HAS_SCALE
from .abi import AOT_MODULE, GEMM_TILE_KERNELS, POOLED_SUFFIX, stub_info


def _aot_namespace(mod) -> SimpleNamespace:
    """The AOT exports under the JIT kernels' names (one export per weight dtype); the
    parallel ones run on the native kernel pool (pool.py), one thread per core unless
    set_threads says otherwise."""
    from .pool import POOL, KernelPool, default_threads

    if not POOL:  # one per core, at most the target's default_threads (a stub records it)
        cap = stub_info().get("default_threads") or default_threads()
        POOL.append(KernelPool(mod.pool_start, min(default_threads(), cap)))
    state = POOL[0].state
    ns = {}
    for name in dir(mod):
        if name.startswith("_") or name == "pool_start":
            continue
        if name.endswith(POOLED_SUFFIX):  # launcher(state, *args)
            ns[name[: -len(POOLED_SUFFIX)]] = functools.partial(getattr(mod, name), state)
        else:
            ns[name] = getattr(mod, name)
    for name in ("dwconv", "dwconv3_flat", "dwconv3_s2", "dwconv_nhwc", "dw3", "embed_rows",
                 "qdwconv3"):  # fmt: skip
        ns[name] = _by_weight_dtype(ns.pop(f"{name}_f32"), ns.pop(f"{name}_i8"))
    for name, arg in (("quantize_pad_nhwc", 0), ("gemm_u8s8", 7)):  # float32 or u8 codes
        ns[name] = _per_weight_type(ns, name, arg, (("", np.float32), ("_u8", np.uint8)))
    ns["gemv"] = _per_weight_type(ns, "gemv", 1, _WEIGHT_BITS[1:])
    qmb = {(np.dtype(w), np.dtype(y)): ns.pop(f"qmbconv_rows_{wn}{yn}")
           for wn, w in (("f32", np.float32), ("i8", np.int8))
           for yn, y in (("", np.float32), ("_u8", np.uint8))}  # fmt: skip
    ns["qmbconv_rows"] = _by_dtype(lambda a: qmb[a[12].dtype, a[30].dtype])  # wd, y
    for name, arg, types_ in (("gemmp", 5, _WEIGHT_BITS), ("wino_conv", 2, _WEIGHT_BITS[:3]),
                              ("mbconv_rows", 2, _WEIGHT_BITS)):  # fmt: skip
        ns[name] = _per_weight_type(ns, name, arg, types_)
    f32, f16 = ns.pop("attention_rows_f32"), ns.pop("attention_rows_f16")
    ns["attention_rows"] = _by_dtype(lambda a: f16 if a[4].dtype == np.uint16 else f32)  # caches
    return SimpleNamespace(build="aot", **ns)


# The weight types a kernel exported once per type takes, as its exports' suffixes and
# the numpy dtypes of the weights it is passed (backend.HALF_BITS: halves as bits).
_WEIGHT_BITS = (("", np.float32), ("_f16", np.uint16), ("_bf16", np.int16), ("_i8", np.int8))


def _per_weight_type(ns: dict, name: str, arg: int, types_) -> object:
    """One kernel over the exports ``name<suffix>`` (removed from ns), picked by the
    dtype of argument ``arg``."""
    by = {np.dtype(t): ns.pop(f"{name}{sfx}") for sfx, t in types_}
    return _by_dtype(lambda a: by[a[arg].dtype])


def _by_weight_dtype(f32, i8):
    return _by_dtype(lambda a: i8 if a[1].dtype == np.int8 else f32)


def _by_dtype(pick):
    """One AOT kernel of several exports (one per dtype), picked by ``pick(args)`` per
    call, or once per call site by ``resolved``."""

    def kernel(*args):
        return pick(args)(*args)

    kernel.pick = pick
    return kernel


def load_kernels() -> SimpleNamespace:
    mode = os.environ.get("EDGEPACK_KERNELS", "auto")
    if mode not in ("auto", "aot", "jit"):
        raise ValueError(f"EDGEPACK_KERNELS={mode!r}; use auto, aot or jit")
    if stub_info():  # an executable has no JIT (no numba): its own builds, whatever asked
        mode = "aot"
    if mode in ("auto", "aot"):
        try:
            mod, cpu = _aot_build()
            ns = _aot_namespace(mod)
            ns.cpu = cpu
        except ImportError:
            if mode == "aot":
                raise
        else:
            ns.HAS_BIAS, ns.HAS_SCALE, ns.HAS_RES = HAS_BIAS, HAS_SCALE, HAS_RES
            return ns
    return _jit_namespace()


def _jit_namespace() -> SimpleNamespace:
    # How idle OpenMP and OpenBLAS threads wait is set in edgepack/__init__.py (both
    # read it when they load).
    from . import gemm_tiles, gemv, q4x16, q8x16, qdot, qdw, qgemm, qmb
    from . import kernels as cpu_numba
    from . import llm as cpu_llm
    from . import nhwc as cpu_nhwc

    names = {k: getattr(cpu_numba, k) for k in dir(cpu_numba) if not k.startswith("_")}
    names.update({k: getattr(cpu_nhwc, k) for k in dir(cpu_nhwc) if k.endswith("_nhwc")})
    names.update({k: getattr(cpu_llm, k) for k in cpu_llm.KERNELS})
    names["gemv"], names["gemv_q4_q8"] = gemv.gemv, qdot.gemv_q4_q8
    names["gemm_q4x16_q8"], names["gemm_q8x16_q8"] = q4x16.gemm_q4x16_q8, q8x16.gemm_q8x16_q8
    names["gemm_u8s8"], names["quantize_pad_nhwc"] = qgemm.gemm_u8s8, qgemm.quantize_pad_nhwc
    names["qdwconv3"], names["qmbconv_rows"] = qdw.qdwconv3, qmb.qmbconv_rows
    shape = gemm_shape()
    for name in GEMM_TILE_KERNELS:
        names[name] = getattr(gemm_tiles, f"{name}_{shape}")
    for k, f in names.items():
        if getattr(f, "targetoptions", {}).get("parallel"):
            names[k] = _by_thread_count(f)
    return SimpleNamespace(build="jit", gemm_shape=shape, **names)


class UnsupportedCPU(ValueError):
    """This CPU lacks features every kernel build of the executable needs."""


def _aot_build():
    """(module, cpu) of the AOT kernels to run: a frozen stub's own builds, else an
    ``edgepack_kernels`` module on the path, else the development install's cached
    build (kernels/cpu/aot_cache.py) for these kernel sources with the most features
    this CPU has. ImportError when there is none."""
    if stub_info():
        b = pick_build(_stub_builds())
        return importlib.import_module(b["module"]), b.get("cpu") or "host"
    try:
        return importlib.import_module(AOT_MODULE), "host"
    except ImportError:
        pass
    from .aot_cache import cached_builds, import_build

    try:  # most features first: the same choice as among an executable's builds
        b = pick_build(cached_builds())
    except UnsupportedCPU as e:  # none this CPU runs: the JIT
        raise ImportError(
            f"no ahead-of-time kernel build for these sources and this CPU ({e})"
        ) from None
    return import_build(b), b["cpu"]


def _stub_builds() -> list[dict]:
    """The kernel builds a frozen stub carries, first preferred (packager/stub.py)."""
    return list(stub_info().get("kernels") or [{"module": AOT_MODULE}])


def host_cpu_flags() -> set[str] | None:
    """The CPU's features as /proc/cpuinfo lists them (None where it cannot be read).
    ``EDGEPACK_CPU_FLAGS`` (space-separated) stands in for them: tests use it to play
    an older CPU."""
    forced = os.environ.get("EDGEPACK_CPU_FLAGS")
    if forced is not None:
        return set(forced.split())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86, aarch64
                    return set(value.split())
    except OSError:
        pass
    return None


def aot_module(builds: list[dict], flags: set[str] | None = None) -> str:
    """The module of ``pick_build``'s build."""
    return pick_build(builds, flags)["module"]


def pick_build(builds: list[dict], flags: set[str] | None = None) -> dict:
    """The first kernel build whose features this CPU has.

    As ONNX Runtime's MLAS picks its kernels from the CPU it starts on: an AVX-512 CPU
    runs the x86-64-v4 build, an AVX2 one the x86-64-v3 build. ``EDGEPACK_KERNEL_CPU``
    names a build to take instead (to compare them). A CPU below the last build (the
    target's own) is refused: its kernels would stop on an illegal instruction."""
    flags = host_cpu_flags() if flags is None else flags
    forced = os.environ.get("EDGEPACK_KERNEL_CPU")
    if forced:
        named = [b for b in builds if b.get("cpu") == forced]
        if not named:
            have = ", ".join(str(b.get("cpu")) for b in builds)
            raise UnsupportedCPU(f"EDGEPACK_KERNEL_CPU={forced}: this executable has kernels "
                                 f"for {have}")  # fmt: skip
        builds = named
    if not builds:
        raise UnsupportedCPU("there are no kernel builds")
    if flags is None:  # /proc/cpuinfo unreadable: the target's own build, its floor
        return builds[-1]
    for b in builds:
        if set(b.get("flags", ())) <= flags:
            return b
    last = builds[-1]
    lacking = sorted(set(last.get("flags", ())) - flags)
    raise UnsupportedCPU(
        f"this CPU lacks {', '.join(lacking)}, which the kernels of this executable need "
        f"(built for {last.get('cpu')}); build for a target that matches it"
    )


def kernel_threads() -> int:
    """Threads the kernels' parallel loops use now: numba's, or the AOT kernel pool's."""
    if K.build != "jit":
        from .pool import POOL

        return POOL[0].threads
    import numba

    return numba.get_num_threads()


def gemm_shape(features: set[str] | None = None, arch: str | None = None) -> str:
    """The GEMM tile shape (``<lanes>x<vectors>``, gemm_tiles.py) for a CPU: the host's
    by default (JIT), the target's for an AOT build. ``EDGEPACK_GEMM_SHAPE`` overrides."""
    forced = os.environ.get("EDGEPACK_GEMM_SHAPE")
    if forced:
        return forced
    import platform

    from .simd import host_features, lanes_for

    arch = arch or ("aarch64" if platform.machine() in ("aarch64", "arm64") else "x86_64")
    lanes, nv = lanes_for(host_features() if features is None else features, arch)
    return f"{lanes}x{nv}"


# The thread count last given to runtime.threads.set_threads (None: ask numba per call).
_threads_set: list[int | None] = [None]


def note_threads(n: int) -> None:
    """Record numba's thread count after setting it, for ``_by_thread_count``."""
    _threads_set[0] = n


def resolved(kern, args: tuple):
    """``kern`` as the compiled function for exactly these arguments' types, for a step
    that calls it with them on every run (bound once).

    A numba call first types every argument and looks up the overload: 1.4 us of a 3 us
    call to gemmp, and MobileNetV2 makes ~130 kernel calls a run (an mbconv chain three
    a band). The compiled entry point only unboxes. Serial or parallel build as
    ``_by_thread_count`` would pick now: the thread count is fixed before binding (the
    kernels' worker counts are bound too). An AOT kernel: its export for these
    arguments' dtypes.
    """
    if K.build != "jit":
        while hasattr(kern, "pick"):
            kern = kern.pick(args)
        return kern
    import numba

    n = _threads_set[0] if _threads_set[0] is not None else numba.get_num_threads()
    disp = getattr(kern, "serial" if n == 1 else "parallel", kern)
    if not hasattr(disp, "typeof_pyval"):
        return kern
    return disp.compile(tuple(disp.typeof_pyval(a) for a in args))


def _by_thread_count(par):
    """Run a parallel kernel's serial build when numba has one thread.

    With one thread a parfor still pays for its scheduler and loses some codegen (the
    loop body becomes a separately compiled gufunc): ResNet-18 took 58 ms serial vs 67
    parallel at one thread. (An AOT kernel at one thread likewise runs whole on the caller.)
    """
    import numba

    f = par.py_func
    clone = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    clone.__qualname__ = f.__qualname__ + "_serial"  # its own entry in numba's disk cache
    ser = numba.njit(cache=True, error_model=par.targetoptions.get("error_model", "python"))(clone)
    get = numba.get_num_threads

    def call(*args):
        n = _threads_set[0]  # asking numba costs ~2.5 us, a third of a small kernel call
        return (ser if (n if n is not None else get()) == 1 else par)(*args)

    call.__name__ = f.__name__
    call.parallel, call.serial = par, ser
    return call


K = load_kernels()
