"""edgepack: pack a trained model into one bundle per edge device and run it there."""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def cache_dir():
    """The one folder edgepack writes to outside what the user names: verified payloads
    (runtime/verified.py) and ahead-of-time kernel builds (kernels/cpu/aot_cache.py).
    $EDGEPACK_CACHE_DIR, else $XDG_CACHE_HOME/edgepack, else ~/.cache/edgepack, else a
    per-user folder under the temporary directory."""
    import tempfile
    from pathlib import Path

    base = _os.environ.get("EDGEPACK_CACHE_DIR")
    if not base:
        xdg = _os.environ.get("XDG_CACHE_HOME") or (
            _os.path.join(_os.environ["HOME"], ".cache") if _os.environ.get("HOME") else None
        )
        base = (
            _os.path.join(xdg, "edgepack")
            if xdg
            else _os.path.join(tempfile.gettempdir(), f"edgepack-{_os.getuid()}")
        )
    return Path(base)

# How idle threads wait, set before numpy (OpenBLAS) and numba's OpenMP pool (libgomp)
# load, since both read it then; a user's own setting of any of these wins.
# - libgomp: with its idle workers asleep at once (OMP_WAIT_POLICY=passive, this
#   package's setting until now; libgomp's own default spins ~100 rounds once it manages
#   more threads than CPUs, as when a server's engine thread launches kernels after the
#   main thread's warm-up), every parallel kernel waits for a worker to wake: 14-16 us a
#   launch on a 2-core Zen 2, against 3 us when they spin 10000 rounds (about 0.1 ms)
#   before sleeping. An LLM decode step makes ~150 launches: SmolLM2 int4, 2 threads,
#   1 row 7.8 -> 6.1 ms, 8 rows 23.4 -> 21.3. An idle process stays idle (~1 ms of CPU
#   in 2 s; plain OMP_WAIT_POLICY=active would burn a core).
# - OpenBLAS (numpy's matmul, which some fp32 linears use): after a call its workers
#   spin for 2^28 cycles (~0.1 s) by default, taking the cores from numba's threads:
#   MobileNetV2 at 2 threads took 24 ms (P99 124) against 12 at one thread, and 70 ms
#   with libgomp's workers spinning too. With a 2^12-cycle spin: 9.7 ms (P99 11).
# - Both spinning long is the worst case (2-thread ResNet-18 once took 188 ms instead of
#   60). So where numpy was imported before edgepack (OpenBLAS loaded, spinning as it
#   was built to), libgomp's idle threads sleep at once, as before.
# - What this package set is recorded in EDGEPACK_THREAD_WAITS, so that a child process
#   (a server a benchmark or test starts) decides afresh instead of taking its parent's
#   choice for the user's: a parent that had imported numpy first handed its passive
#   wait down, and `edgepack serve` under scripts/bench_serve.py decoded one stream at
#   11 ms a token instead of 6 (llama-server, inheriting it too, at 19 instead of 5).
_MARK = "EDGEPACK_THREAD_WAITS"


def _drop_our_waits(env) -> None:
    for k, _, v in (kv.partition("=") for kv in env.pop(_MARK, "").split(",") if kv):
        if env.get(k) == v:
            del env[k]


def foreign_environ() -> dict:
    """This process's environment without the wait settings this package made: for
    starting another program (a peer a benchmark compares with), which would otherwise
    run with edgepack's choice as if the user had made it."""
    env = dict(_os.environ)
    _drop_our_waits(env)
    return env


_drop_our_waits(_os.environ)
_set = {}
# False where numpy came first with OpenBLAS's own 0.1 s spin (runtime/threads.py
# blas_threads then keeps BLAS on the calling thread)
BLAS_SPINS_SHORT = "numpy" not in _sys.modules or any(
    k in _os.environ for k in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")
)
if "OPENBLAS_THREAD_TIMEOUT" not in _os.environ and "GOTO_THREAD_TIMEOUT" not in _os.environ:
    _set["OPENBLAS_THREAD_TIMEOUT"] = "12"
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    if BLAS_SPINS_SHORT:
        _set["OMP_WAIT_POLICY"], _set["GOMP_SPINCOUNT"] = "active", "10000"
    else:
        _set["OMP_WAIT_POLICY"] = "passive"
_os.environ.update(_set)
if _set:
    _os.environ[_MARK] = ",".join(f"{k}={v}" for k, v in _set.items())
