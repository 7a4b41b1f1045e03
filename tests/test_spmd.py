"""The parallel kernels as device executables run them: their SPMD form (kernels/cpu/
spmd.py) launched on the native kernel pool (kernels/cpu/native_pool.py, pool.py).

The launchers are compiled here by the JIT from the same source the AOT build compiles;
their results must equal the serial build's bit for bit on any number of parts. The
frozen tests run the AOT build's the same way inside the executable (one thread per
core by default).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from edgepack.kernels.cpu import kernels as cpu_kernels
from edgepack.kernels.cpu import llm as cpu_llm
from edgepack.kernels.cpu import native_pool, spmd
from edgepack.kernels.cpu.jit import njit
from edgepack.kernels.cpu.native import K
from edgepack.kernels.cpu.pool import KernelPool
from numba import prange

pytestmark = [pytest.mark.cpu, pytest.mark.skipif(K.build != "jit", reason="JIT build")]


def _launcher(kernel):
    return njit(nogil=True)(native_pool.launcher(kernel))


def _pool(threads: int) -> KernelPool:
    return KernelPool(native_pool.pool_start, threads)


def _parallel_kernels():
    from edgepack.kernels.cpu import gemm_tiles, gemv, nhwc, q4x16, q8x16, qdot, qdw, qgemm, qmb

    for mod in (cpu_kernels, nhwc, cpu_llm, qdot, q4x16, q8x16, gemv, gemm_tiles, qdw, qgemm,
                qmb):  # fmt: skip
        for name in dir(mod):
            f = getattr(mod, name)
            parallel = getattr(f, "targetoptions", {}).get("parallel")
            if parallel and f.py_func.__module__ == mod.__name__:
                yield f


def test_every_parallel_kernel_has_an_spmd_form():
    """The AOT build exports each in this form: a kernel it cannot split fails here first."""
    kernels = list(_parallel_kernels())
    assert len(kernels) >= 40
    for f in kernels:
        name, src = spmd.spmd_source(f.py_func)
        assert "prange" not in src and "_part" in src, name


@numba.njit(parallel=True)
def _phases(x, y, z, out):
    """Two parallel loops and serial writes around them: the SPMD form needs a barrier
    after the first loop and part 0 alone for the serial stores."""
    n = x.shape[0]
    for i in range(n):  # serial writes the first loop reads
        y[i] = x[i] * 2.0
    for i in prange(n):
        z[i] = y[n - 1 - i] + 1.0  # reads what another part's share wrote
    s = 0.0
    for i in prange(n):
        out[i] = z[(i * 7) % n] * 3.0
    out[0] += s


def test_barriers_and_serial_writes_give_the_serial_answer():
    f = _launcher(_phases)
    pool = _pool(3)
    x = np.arange(1001, dtype=np.float64)
    want = [np.zeros_like(x) for _ in range(3)]
    _phases.py_func(x, *want)
    for parts in (3, 2, 1):
        pool.resize(parts)
        for _ in range(30):  # shares finish in every order
            got = [np.full_like(x, np.nan) for _ in range(3)]
            f(pool.state, x, *got)
            for g, w in zip(got, want):
                assert np.array_equal(g, w), parts


@numba.njit(parallel=True)
def _sum_into(x, acc):
    s = 0.0
    for i in prange(x.shape[0]):
        s += x[i]
    acc[0] = s


def test_a_reduction_is_refused_with_its_name():
    with pytest.raises(spmd.NotSplittable, match="reduction into 's'"):
        spmd.spmd_source(_sum_into.py_func)


def test_act_into_on_every_part_count():
    f = _launcher(cpu_kernels.act_into)
    x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    want = np.empty_like(x)
    cpu_kernels.act_into.py_func(x, want, 6, 0.0, 0.0)  # SiLU
    pool = _pool(4)
    for parts in (1, 2, 3, 4):
        pool.resize(parts)
        assert pool.threads == parts
        got = np.full_like(x, np.nan)
        f(pool.state, x, got, 6, 0.0, 0.0)
        assert np.array_equal(got, want), parts


def _attention(fn, *, pos):
    """attention_rows on a small cache: (keys, values, output)."""
    rng = np.random.default_rng(1)
    heads, kvh, hd, slots, ctx, rows, workers = 4, 2, 8, 3, 16, 5, 3
    qkv = rng.standard_normal((rows, (heads + 2 * kvh) * hd)).astype(np.float32)
    slot = np.array([0, 0, 0, 1, 2], np.int32)
    kc = np.zeros((slots, ctx, kvh, hd), np.float32)
    vc = np.zeros_like(kc)
    out = np.full((rows, heads * hd), np.nan, np.float32)
    sc = np.zeros(workers * (heads // kvh) * ctx, np.float32)
    acc = np.zeros(workers * (heads // kvh) * hd, np.float32)
    fn(qkv, qkv.view(np.uint32), np.array(pos, np.int32), slot, kc, vc, out, sc, acc,
       heads, kvh, hd, hd**-0.5, 0, 0.0, False)  # fmt: skip
    return kc, vc, out


def test_attention_stores_once_then_reads_and_raises_as_the_serial_kernel():
    """attention_rows stores the new keys and values serially (part 0) before the
    parallel part reads the cache; a position outside the cache raises the serial
    kernel's error from the launcher (a part's error is raised by running it whole)."""
    pool = _pool(3)
    f = _launcher(cpu_llm.attention_rows)
    want = _attention(cpu_llm.attention_rows.py_func, pos=[0, 1, 2, 0, 5])
    for _ in range(20):
        got = _attention(lambda *a: f(pool.state, *a), pos=[0, 1, 2, 0, 5])
        for g, w in zip(got, want):
            assert np.array_equal(g, w)
    with pytest.raises(IndexError, match="outside the KV cache"):
        _attention(lambda *a: f(pool.state, *a), pos=[0, 1, 2, 0, 99])
    got = _attention(lambda *a: f(pool.state, *a), pos=[0, 1, 2, 0, 5])  # the pool goes on
    assert np.array_equal(got[2], want[2])


def test_helper_spin_is_set_from_the_environment(monkeypatch):
    """EDGEPACK_POOL_SPIN reaches the state the helpers read (0: the compiled SPIN);
    anything but a whole number of polls is refused by name."""
    from edgepack.kernels.cpu import pool as pool_mod

    monkeypatch.setenv("EDGEPACK_POOL_SPIN", "1")
    assert pool_mod.spin_polls() == 1
    assert KernelPool(lambda state, n: None).state[pool_mod.POOL_SPIN] == 1
    monkeypatch.delenv("EDGEPACK_POOL_SPIN")
    assert pool_mod.spin_polls() == 0 and native_pool.SPIN == 1 << 20
    for bad in ("2ms", "-5"):
        monkeypatch.setenv("EDGEPACK_POOL_SPIN", bad)
        with pytest.raises(ValueError, match="EDGEPACK_POOL_SPIN"):
            pool_mod.spin_polls()


def test_helpers_sleep_while_the_cores_are_lent_to_blas():
    """pool.lend_cores: a helper spinning after a job (here it would spin for ever) goes
    to sleep while the lent call runs, so that BLAS's own threads get its core, and the
    next kernel wakes it with the right answer."""
    import time

    from edgepack.kernels.cpu.pool import POOL_PARK, lend_cores

    pool = _pool(2)
    st = pool.state
    st[native_pool.SPIN_AT] = 1 << 60  # read by the helper after its next job
    f = _launcher(cpu_kernels.act_into)
    x = np.arange(40_000, dtype=np.float32)
    got = np.zeros_like(x)
    asleep = native_pool.TICKETS + 8 + 1  # helper 1's sleeping flag
    f(st, x, got, 0, 0.0, 0.0)
    time.sleep(0.05)
    assert st[asleep] == 0, "the helper slept without being asked"

    def blas_call(deadline):
        while st[asleep] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return int(st[POOL_PARK]), int(st[asleep])

    assert lend_cores(blas_call, [pool])(time.monotonic() + 10) == (1, 1)
    assert st[POOL_PARK] == 0
    got[:] = 0
    f(st, x, got, 0, 0.0, 0.0)
    assert np.array_equal(got, x)
    st[native_pool.SPIN_AT] = 1  # and to sleep for good: not a core spun for the session
    assert lend_cores(blas_call, [pool])(time.monotonic() + 10) == (1, 1)
    assert lend_cores(lambda: "no pool", [])() == "no pool"


def test_threads_start_once_and_a_busy_pool_runs_the_kernel_whole():
    pool = _pool(2)
    state = pool.state
    assert pool.threads == 2
    pool.resize(2)
    assert state[native_pool.STARTED] == 2  # no second helper
    state[native_pool.LOCK] = 1  # another caller holds it: run on this thread alone
    f = _launcher(cpu_kernels.act_into)
    x = np.arange(40_000, dtype=np.float32)
    got = np.zeros_like(x)
    f(state, x, got, 0, 0.0, 0.0)
    assert np.array_equal(got, x) and state[native_pool.LOCK] == 1
    state[native_pool.LOCK] = 0
    with pytest.raises(ValueError):
        pool.resize(0)


def test_parts_are_claimed_unless_they_meet_at_barriers():
    assert not spmd.spmd_function(cpu_kernels.act_into.py_func).parts_wait
    assert spmd.spmd_function(_phases.py_func).parts_wait


def test_the_caller_runs_the_parts_of_a_helper_that_never_comes():
    """A helper that is not running (asleep behind a slow wake, or its core taken by
    another process) leaves its part to the caller: parts are claimed (native_pool.py).
    Here the state counts two threads and no helper exists; dealt one part a thread,
    the call would wait for ever."""
    import threading

    f = _launcher(cpu_kernels.act_into)
    state = np.zeros(native_pool.STATE_LEN, np.int64)
    state[native_pool.WANT] = state[native_pool.STARTED] = 2
    x = np.arange(50_000, dtype=np.float32)
    got = np.zeros_like(x)
    call = threading.Thread(target=f, args=(state, x, got, 0, 0.0, 0.0), daemon=True)
    call.start()
    call.join(timeout=30)
    assert not call.is_alive(), "the caller waited for a helper that does not exist"
    assert np.array_equal(got, x)
    assert state[native_pool.DONE] == 2 and state[native_pool.LOCK] == 0


def test_claimed_and_dealt_jobs_in_turn_give_the_serial_answers():
    """Helpers that come late to a claimed job find the next one published (a dealt one
    with barriers, or claimed again): each job's parts run once, from its own fields."""
    act, phases = _launcher(cpu_kernels.act_into), _launcher(_phases)
    pool = _pool(2)
    x = np.random.default_rng(2).standard_normal(4_099).astype(np.float32)
    want = np.empty_like(x)
    cpu_kernels.act_into.py_func(x, want, 6, 0.0, 0.0)
    xp = np.arange(257, dtype=np.float64)
    want_p = [np.zeros_like(xp) for _ in range(3)]
    _phases.py_func(xp, *want_p)
    for i in range(600):
        got = np.full_like(x, np.nan)
        act(pool.state, x, got, 6, 0.0, 0.0)
        assert np.array_equal(got, want), i
        if i % 3 == 0:
            got_p = [np.full_like(xp, np.nan) for _ in range(3)]
            phases(pool.state, xp, *got_p)
            for g, w in zip(got_p, want_p):
                assert np.array_equal(g, w), i
