#!/usr/bin/env python3
"""Check every CPU kernel against the NumPy reference on aarch64, on an x86_64 host.

    bash scripts/aarch64_sysroot.sh                  # once: the arm64 sysroot (see there)
    python scripts/check_kernels_aarch64.py          # cortex-a72 (Raspberry Pi 4)
    python scripts/check_kernels_aarch64.py --cpu cortex-a76          # Raspberry Pi 5
    python scripts/check_kernels_aarch64.py --target jetson-orin-nano # cpu + features of a target
    python scripts/check_kernels_aarch64.py --target rpi5 --aot  # the stub's cross-built kernels

The host half of this script (no ``--inner``) builds a symlink farm that makes
``import edgepack.kernels`` work from the repository (the host's editable install maps
the top-level folders into the ``edgepack`` namespace; that mapping does not exist in
the sysroot), then starts this same file under

    qemu-aarch64-static -cpu CPU -L SYSROOT SYSROOT/usr/bin/python3.11 ... --inner

where Debian's arm64 python3.11 with the aarch64 numpy / numba / llvmlite wheels runs
the kernels: numba JIT-compiles them for aarch64 with its CPU pinned (NUMBA_CPU_NAME,
NUMBA_CPU_FEATURES) the way a device executable pins it, into a throw-away cache.

The inner half reuses tests/test_kernels.py as it is: its case tables (CASES), its
dispatch-table walk (CPU_KEYS) and its runner (test_cpu_kernel: NaN-poisoned outputs
and scratch inside guard bands, read-only weights, bind once and run twice, per-op
tolerances), plus test_cpu_weight_decode_is_exact for every int8 / fp16 weight kernel.
That module imports onnx only for packager.onnx_import._pool_out (a pure function);
onnx is not installed in the sysroot, so a placeholder module stands in for it.

Almost all of the time goes into numba compiling the kernels under emulation (running
the 350 cases takes seconds), so the (op, dtype) keys are split between ``--jobs``
qemu processes (default 2), grouped so that ops sharing kernels compile them once.

Output: one line per (op, dtype) of the dispatch table, then, as the last line,
``aarch64 kernel check: N passed, M failed``. The exit status is non-zero when
anything failed; a qemu/python process that dies (a crash, SIGILL) counts as a failure.

qemu is given the target's CPU model (``-cpu cortex-a72``) when it has one, so that
code using an instruction the board lacks traps here as it would there (SIGILL), and
numpy / OpenBLAS pick the same runtime-dispatched kernels as on the board; for CPUs
qemu does not model (cortex-a78, carmel) it runs its ``max`` CPU, a superset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = "aarch64 kernel check: {passed} passed, {failed} failed"
SHARD_RESULT = "shard-result "  # an inner process's counts, for the host (not printed)
# Seconds of numba compilation per op under qemu (cortex-a72, numba 0.68, 2-core Zen 3
# host), measured with --verbose; only used to balance the shards. Ops that share
# kernels (binary, unary and matmul all use act_into) stay in one shard.
OP_GROUPS: list[tuple[tuple[str, ...], float]] = [
    (("dwconv",), 284.0),
    (("linear",), 133.0),
    (("conv",), 92.0),
    (("binary", "unary", "matmul"), 90.0),
    (("maxpool",), 29.0),
    (("avgpool",), 25.0),
    (("softmax",), 17.0),
    (("channel_affine",), 16.0),
    (("global_avgpool",), 8.0),
    (("reshape", "transpose", "concat", "pad", "reduce_mean"), 0.0),  # NumPy calls only
]
UNKNOWN_OP_COST = 30.0
# CPU models qemu-user 7.2 (Debian bookworm) emulates; others run on "max".
QEMU_CPUS = (
    "cortex-a35",
    "cortex-a53",
    "cortex-a57",
    "cortex-a72",
    "cortex-a76",
    "neoverse-n1",
    "a64fx",
    "max",
)


# --- host side --------------------------------------------------------------------------


def _package_dirs() -> dict[str, Path]:
    """``edgepack.*`` package -> repository folder, from pyproject's package-dir."""
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs = cfg["tool"]["setuptools"]["package-dir"]
    return {pkg: REPO / d for pkg, d in dirs.items()}


def _symlink_farm(dest: Path) -> None:
    """dest/edgepack/{files of edgepack/} plus dest/edgepack/kernels -> REPO/kernels, ..."""
    dirs = _package_dirs()
    top = dest / "edgepack"
    top.mkdir()
    for f in dirs.pop("edgepack").iterdir():
        if f.name != "__pycache__":
            (top / f.name).symlink_to(f)
    for pkg, d in dirs.items():
        parts = pkg.split(".")
        assert parts[0] == "edgepack", pkg
        if len(parts) > 2:  # a sub-package inside its parent's folder: the parent's link
            parent = dirs[".".join(parts[:-1])]  # already brings it
            assert d.resolve() == (parent / parts[-1]).resolve(), pkg
            continue
        link = top / parts[1]
        if link.is_symlink():
            link.unlink()  # a sub-package folder wins over a same-named file/link
        link.symlink_to(d, target_is_directory=True)


def _target_cpu(name: str) -> tuple[str, str]:
    """(cpu, llvm feature string) of a target file, via edgepack.targets on the host."""
    from edgepack.targets import load_target

    t = load_target(name)
    if t.arch != "aarch64":
        sys.exit(f"target {name} is {t.arch}, not aarch64")
    features = t.llvm_features  # a property ("+neon,+dotprod,+fullfp16")
    return t.cpu, features() if callable(features) else features


def host_main(args: argparse.Namespace) -> int:
    t0 = time.time()
    root = Path(args.sysroot).resolve()
    py = root / "usr/bin/python3.11"
    if not py.exists() or not (root / ".edgepack-sysroot").exists():
        print(f"no sysroot at {root}; building it with scripts/aarch64_sysroot.sh", flush=True)
        subprocess.run(["bash", str(REPO / "scripts/aarch64_sysroot.sh"), str(root)], check=True)
    cpu, features = args.cpu, args.cpu_features
    if args.target:
        cpu, tfeatures = _target_cpu(args.target)
        if features is None:
            features = tfeatures
    if features is None:
        features = ""  # the CPU model's own features (not the qemu/host CPU's)
    qemu_cpu = args.qemu_cpu or (cpu if cpu in QEMU_CPUS else "max")
    aot_env = {}
    if args.aot:  # the target's kernels cross-compiled on this host, as its stub ships them
        from edgepack.packager.aot import ensure_kernel_builds
        from edgepack.targets import cpuinfo_flags, load_target

        from edgepack import cache_dir

        if not args.target:
            sys.exit("--aot needs --target (whose kernel builds to check)")
        t = load_target(args.target)
        builds = ensure_kernel_builds(t)
        # qemu shows the host's /proc/cpuinfo: the runtime is told the target's flags
        aot_env = {"EDGEPACK_KERNELS": "aot", "EDGEPACK_CACHE_DIR": str(cache_dir()),
                   "EDGEPACK_CPU_FLAGS": " ".join(cpuinfo_flags(t.arch, t.cpu_features))}
        print(f"aot kernels: {', '.join(str(f) for _, _, f in builds)}", flush=True)
        args.jobs = 1  # nothing to compile under qemu

    jobs = max(1, args.jobs)
    with tempfile.TemporaryDirectory(prefix="edgepack-aarch64-") as tmp:
        tmp = Path(tmp)
        # With --numba-cache the farm must keep its path: numba keys cache entries by
        # the source file's path.
        farm = (Path(args.numba_cache).resolve() / "pythonpath") if args.numba_cache else tmp
        farm = farm / "path"
        if farm.exists():
            shutil.rmtree(farm)
        farm.mkdir(parents=True)
        _symlink_farm(farm)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "NUMBA_", "EDGEPACK_", "QEMU_"))
        }
        env.update(
            PYTHONPATH=os.pathsep.join([str(farm), str(REPO / "tests")]),
            PYTHONNOUSERSITE="1",
            PYTHONPYCACHEPREFIX=str(tmp / "pycache"),  # nothing written into the repo
            NUMBA_CPU_NAME=cpu,
            NUMBA_CPU_FEATURES=features,
            EDGEPACK_KERNELS="jit",  # a host-built AOT module is x86_64 code anyway
            EDGEPACK_CHECK_QEMU_CPU=qemu_cpu,
        )
        env.update(aot_env)
        if args.threads:
            env["NUMBA_NUM_THREADS"] = str(args.threads)
        cmd = [args.qemu, "-cpu", qemu_cpu, "-L", str(root), str(py), "-X", "faulthandler"]
        cmd += [str(Path(__file__).resolve()), "--inner"]
        cmd += ["--verbose"] * args.verbose
        print(f"$ {' '.join(cmd)} --shard I/{jobs}", flush=True)
        print(f"  NUMBA_CPU_NAME={cpu} NUMBA_CPU_FEATURES={features!r}", flush=True)
        procs = []
        for i in range(jobs):
            cache = Path(args.numba_cache).resolve() if args.numba_cache else tmp / "numba"
            penv = dict(env, NUMBA_CACHE_DIR=str(cache / f"shard{i}of{jobs}"))
            procs.append(
                subprocess.Popen(
                    cmd + ["--shard", f"{i}/{jobs}"],
                    env=penv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    bufsize=1,
                )
            )
        results: list[dict | None] = [None] * jobs
        lock = threading.Lock()

        def pump(i: int, proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(SHARD_RESULT):
                    results[i] = json.loads(line[len(SHARD_RESULT) :])
                    continue
                with lock:
                    tag = f"[{i + 1}/{jobs}] " if jobs > 1 and not _is_key_line(line) else ""
                    print(tag + line, end="", flush=True)

        threads = [threading.Thread(target=pump, args=(i, p)) for i, p in enumerate(procs)]
        for t in threads:
            t.start()
        deadline = t0 + args.timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                timed_out = True
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                p.wait()
        for t in threads:
            t.join()

    passed = failed = specs = 0
    for i, (p, r) in enumerate(zip(procs, results)):
        if r is None:  # died before reporting: a crash (e.g. SIGILL), a kill, a timeout
            failed += 1
            why = "timed out" if timed_out else f"exited with status {p.returncode}"
            print(
                f"  FAILED shard {i + 1}/{jobs}: qemu/python {why} before reporting "
                "(a faulthandler traceback above names the kernel that was running)",
                flush=True,
            )
            continue
        passed += r["passed"]
        failed += r["failed"]
        specs += r["specialisations"]
    print(f"numba: {specs} kernel specialisations compiled for {cpu}", flush=True)
    print(
        f"wall time {time.time() - t0:.1f} s ({jobs} qemu processes; numba compilation included)",
        flush=True,
    )
    print(SUMMARY.format(passed=passed, failed=failed), flush=True)
    return 1 if failed else 0


def _is_key_line(line: str) -> bool:
    """Per-(op, dtype) result lines are self-describing: no shard tag."""
    head = line.split(":", 1)[0]
    return head.count("/") == 1 and " " not in head or line.startswith("  FAILED")


# --- aarch64 side (under qemu) ----------------------------------------------------------


def _stub_onnx() -> None:
    """A placeholder for onnx: test_kernels needs onnx_import._pool_out, not onnx."""
    import types

    class _Missing(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError(f"onnx.{name}: onnx is not installed in the aarch64 sysroot")

    onnx = _Missing("onnx")
    for sub in ("helper", "numpy_helper"):
        m = _Missing(f"onnx.{sub}")
        setattr(onnx, sub, m)  # ModuleType.__setattr__: no __getattr__ involved
        sys.modules[f"onnx.{sub}"] = m
    sys.modules["onnx"] = onnx


def _fmt_exc(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: " + (" | ".join(lines[:6]) if lines else "")


def _shard_keys(keys: list[tuple[str, str, str]], shard: int, n: int) -> list:
    """The (op, dtype, backend) keys of shard ``shard`` of ``n``: whole op groups,
    dealt greedily (largest compile cost first) to the least loaded shard."""
    groups = {op: (g, cost) for g, cost in OP_GROUPS for op in g}
    todo: dict[tuple[str, ...], float] = {}
    for op, _, _ in keys:
        g, cost = groups.get(op, ((op,), UNKNOWN_OP_COST))
        todo[g] = cost
    load = [0.0] * n
    mine: set[str] = set()
    for g, cost in sorted(todo.items(), key=lambda kv: (-kv[1], kv[0])):
        i = load.index(min(load))
        load[i] += cost
        if i == shard:
            mine.update(g)
    return [k for k in keys if k[0] in mine]


def _specialisations() -> int:
    from numba.core.registry import CPUDispatcher

    mod = sys.modules.get("edgepack.kernels.cpu.kernels")
    if mod is None:
        return 0
    return sum(len(d.signatures) for d in vars(mod).values() if isinstance(d, CPUDispatcher))


def inner_main(args: argparse.Namespace) -> int:
    import platform
    import traceback
    from functools import partial

    t_start = time.time()
    shard, n = (int(x) for x in args.shard.split("/"))
    _stub_onnx()
    import numba
    import numpy as np
    import test_kernels as T  # tests/test_kernels.py: cases, dispatch walk, runner
    from edgepack.kernels import registry
    from numba.core.registry import cpu_target

    native = sys.modules.get("edgepack.kernels.cpu.native")
    kbuild = getattr(getattr(native, "K", None), "build", "jit")
    cg = cpu_target.target_context.codegen()
    tm_cpu, tm_features = cg._get_host_cpu_name(), cg._get_host_cpu_features()
    if shard == 0:
        print(
            f"python {platform.python_version()} on {platform.machine()} "
            f"(qemu -cpu {os.environ.get('EDGEPACK_CHECK_QEMU_CPU', '?')}), "
            f"numpy {np.__version__}, numba {numba.__version__}, kernels: {kbuild}",
            flush=True,
        )
        print(
            f"numba target: {cg._tm.triple} cpu={tm_cpu} features={tm_features!r} "
            f"threads={numba.config.NUMBA_NUM_THREADS} "
            f"(imports {time.time() - t_start:.1f} s)",
            flush=True,
        )
    if platform.machine() != "aarch64":
        print("not running on aarch64: start this through the host side, not with --inner")
        return 2

    passed = failed = 0
    if shard == 0:
        T.test_every_kernel_has_cases("cpu")
        passed += 1
    by_key: dict[tuple[str, str], list] = {}
    for param in T.PARAMS:  # the cases test_cpu_kernel runs (each case's dtypes, layouts)
        op, dt, case = param.values
        by_key.setdefault((op, dt), []).append(case)
    for op, dt, _ in _shard_keys(T.CPU_KEYS, shard, n):
        cases = by_key.get((op, dt), [])
        t_key = time.time()
        ok, bad = 0, []
        runs = [(c.name, partial(T.test_cpu_kernel, op, dt, c)) for c in cases]
        extra = ""
        # the weight types test_weight_decode_is_exact covers (its _DECODE list)
        if (op in registry.WEIGHT_OPS and dt != "f32" and op != "qconv"
                and T.wtypes.get(dt).per_element == 1):  # fmt: skip
            runs.append(
                ("weight_decode_is_exact", partial(T.test_weight_decode_is_exact, "cpu", op, dt))
            )
            extra = " + exact decode"
        for name, run in runs:
            t_case, n_spec = time.time(), _specialisations()
            try:
                run()
                ok += 1
            except Exception as e:  # an assertion, or a numba typing/lowering error
                bad.append((name, e))
                if args.verbose:
                    traceback.print_exc()
            if args.verbose:
                print(
                    f"    {op}/{dt} {name}: {time.time() - t_case:.1f} s, "
                    f"+{_specialisations() - n_spec} specialisations",
                    flush=True,
                )
        passed += ok
        failed += len(bad)
        print(
            f"{op}/{dt}: {ok} passed, {len(bad)} failed "
            f"({len(cases)} cases{extra}, {time.time() - t_key:.1f} s)",
            flush=True,
        )
        for name, e in bad:
            print(f"  FAILED {op}/{dt} {name}: {_fmt_exc(e)}", flush=True)
    if shard == 0:
        try:
            T.test_cpu_pad_refuses_other_modes()
            passed += 1
        except Exception as e:
            failed += 1
            print(f"  FAILED pad_refuses_other_modes: {_fmt_exc(e)}", flush=True)
    result = {"passed": passed, "failed": failed, "specialisations": _specialisations()}
    print(SHARD_RESULT + json.dumps(result), flush=True)
    if n == 1 and not args.shard_given:  # run by hand: print the summary too
        print(SUMMARY.format(**result), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sysroot",
        help="arm64 sysroot made by scripts/aarch64_sysroot.sh (default: $EDGEPACK_AARCH64_ROOT, "
        "else aarch64-sysroot in edgepack's cache)",
    )
    ap.add_argument(
        "--cpu",
        default="cortex-a72",
        help="LLVM CPU name numba compiles for (NUMBA_CPU_NAME; default "
        "%(default)s = Raspberry Pi 4; cortex-a76 = Pi 5)",
    )
    ap.add_argument(
        "--cpu-features",
        default=None,
        help="NUMBA_CPU_FEATURES, e.g. '+neon,+dotprod' (default: the CPU "
        "model's own features, or the target's with --target)",
    )
    ap.add_argument("--target", help="take --cpu and --cpu-features from targets/<NAME>.toml")
    ap.add_argument("--qemu", default="qemu-aarch64-static")
    ap.add_argument(
        "--qemu-cpu", help="qemu -cpu model (default: --cpu when qemu has it, else max)"
    )
    ap.add_argument("--threads", type=int, help="NUMBA_NUM_THREADS under qemu")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds (default %(default)s)")
    ap.add_argument(
        "--numba-cache",
        metavar="DIR",
        help="NUMBA_CACHE_DIR to keep between runs (default: a fresh temporary "
        "folder, so every kernel is compiled for the CPU under test)",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="per-case times and new numba specialisations; tracebacks",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="qemu processes compiling in parallel (default %(default)s)",
    )
    ap.add_argument(
        "--aot",
        action="store_true",
        help="check the target's kernels compiled ahead of time (cross-compiled on this "
        "host into the kernel cache, packager/aot_cross.py) instead of numba's JIT",
    )
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.shard_given = args.shard is not None
    args.shard = args.shard or "0/1"
    if args.inner:
        return inner_main(args)
    if args.sysroot is None:
        from edgepack.packager.aot_cross import sysroot

        args.sysroot = str(sysroot())
    return host_main(args)


if __name__ == "__main__":
    sys.exit(main())
