"""A thread pool in the kernels' own machine code, for the ahead-of-time build.

numba's ahead-of-time compiler has no parallel loops (its parfors need numba's
threading layer at run time), so the device executable ran every kernel on one core.
Here each parallel kernel is compiled in two pieces from its source: its SPMD form
(spmd.py: part ``p`` of ``n`` does its share of each parallel loop) and a *launcher*
with the kernel's own arguments plus the pool's state, which

1. takes the pool (a compare-and-swap on the state; a second caller busy elsewhere
   runs its kernel whole instead of waiting),
2. publishes the job (the address of a function that runs one part, and of the
   kernel's arguments packed on the caller's stack) and bumps a ticket per helper,
3. runs part 0 itself, then, for a kernel whose parts never wait for each other (no
   barrier in its SPMD form), claims and runs every part no helper has claimed yet,
   then polls until every part has finished.

Helpers are POSIX threads started by ``pool_start``; each polls its own ticket (own
cache line, with the CPU's pause hint) for ``SPIN`` polls (about 2 ms) after a job,
then sleeps on it with a futex; at once while the caller has lent the cores to BLAS
(``PARK``, pool.lend_cores). A launch therefore costs a few atomic operations when
the helpers are awake, as libgomp's active wait does (docs/cpu-kernels.md has the measurements), and
no Python runs on the helpers: the GIL is released for the whole kernel.

Parts are claimed, not dealt (kernels without barriers): each part goes to whichever
thread takes it first from the job's claim word (its generation and the next unclaimed
part, compare-and-swap). Dealt one part a thread, the caller waited for a helper that
was not running: asleep behind a futex wake (10-50 us on these VMs, more after an idle
spell) or while another process had its core. Claimed, the caller runs a late
helper's part itself: next to one busy process, MobileNetV2 int8 at 2 threads went
from a P99 of 89-92 ms to 9-13 ms (docs/cpu-kernels.md, "Threads in the executable").
Kernels with barriers keep one part per thread (a thread running two of them would
wait at a barrier for itself).

A helper reads the job as a seqlock reader: the generation ``GEN`` is odd while the
launcher writes a job, and a helper takes the job's fields only when GEN was even and
the same before and after reading them. A helper that comes late may find its job
finished and the next one published; it claims only from a claim word of the
generation it read, so it never runs a part of a job whose fields it did not read.

A part that raises (attention's check of its positions) cannot unwind another thread:
the launcher then runs the kernel again whole on the caller, which raises the same
error (the kernels check their arguments before writing anything).

State (int64, ``STATE_LEN``): the barrier's counters (spmd.barrier), then the job, the
lock and the counts, each group on its own 64-byte line, then per helper ``i`` its
ticket and sleeping flag at ``TICKETS + 8 * i``.
"""

from __future__ import annotations

import inspect

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import atomics
from .abi import POOL_PARK as PARK
from .abi import POOL_SPIN as SPIN_AT
from .abi import POOL_STARTED as STARTED
from .abi import POOL_STATE_LEN as STATE_LEN
from .abi import POOL_WANT as WANT
from .jit import ERROR_MODEL, njit
from .spmd import spmd_function

# state layout (int64 indices); 0-1: spmd.barrier
FN, DATA, PARTS, DONE, FAILED = 8, 9, 10, 11, 12  # the job (written before the tickets)
CLAIM, GEN, CLAIMED = 13, 14, 15  # claim word, seqlock generation, whether parts are claimed
PART_BITS = 16  # the claim word: generation << PART_BITS | next part to claim
LOCK = 16
TICKETS = 32  # helper i (1..): ticket at TICKETS + 8 i, sleeping flag at + 1
MAX_THREADS = (STATE_LEN - TICKETS) // 8
# Polls with the pause hint before a helper sleeps: 2^20, about 2 ms on the EPYC VMs
# (ONNX Runtime's workers spin 2^20 pause iterations too). A helper that slept after
# 20000 (30-50 us) let its vCPU halt, and the host then took ms to run it again:
# MobileNetV2 int8x8 at 2 threads, rounds of 5 runs 50 ms apart, P99 10.1 ms (twice;
# 45 of the 53 runs over twice the median were a round's first) -> 3.2-4.8 ms, none
# over twice the median. EDGEPACK_POOL_SPIN sets it per process (pool.py).
SPIN = 1 << 20
WAIT_SPIN = 20000  # polls a launcher waits on a helper's part before yielding its core

_I8P = ir.IntType(8).as_pointer()
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_PART_FN = ir.FunctionType(_I32, [_I8P, _I64, _I64])  # (arguments, part, parts) -> failed


@intrinsic
def _call_part(typingctx, fn, data, part, parts):
    """fn(data, part, parts) for a part function's address: whether the part failed."""

    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], _PART_FN.as_pointer())
        failed = builder.call(f, [builder.inttoptr(args[1], _I8P), args[2], args[3]])
        return builder.zext(failed, _I64)

    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


@njit
def _helper(st, me):
    """Helper ``me``'s life: wait for a ticket, read the newest job, run its part ``me``
    or claim parts of it, report each part done."""
    t, last, seen = TICKETS + 8 * me, 0, 0
    while True:
        spins = 0
        spin = atomics.load(st, SPIN_AT)
        spin = spin if spin > 0 else SPIN
        while atomics.load(st, t) == last:
            spins += 1
            if spins < spin and atomics.load(st, PARK) == 0:
                atomics.pause()
                continue
            atomics.store(st, t + 1, 1)  # sleeping: the launcher wakes this ticket
            atomics.add(st, t + 1, 0)  # (a full fence between the flag and the re-read)
            if atomics.load(st, t) == last:
                atomics.futex(st, t, atomics.FUTEX_WAIT, last)
            atomics.store(st, t + 1, 0)
            spins = 0
        last = atomics.load(st, t)
        gen, fn, data, parts, claimed = _read_job(st)
        if gen == seen:  # a job this helper has already run or found finished
            continue
        seen = gen
        if claimed:
            _claim_parts(st, gen, fn, data, parts)
        elif me < parts:
            if _call_part(fn, data, me, parts):
                atomics.store(st, FAILED, 1)
            atomics.add(st, DONE, 1)


@njit
def _read_job(st):
    """(generation, fn, data, parts, claimed) of the job published last (seqlock read)."""
    while True:
        gen = atomics.load(st, GEN)
        if gen & 1:  # being written
            atomics.pause()
            continue
        fn, data, parts = atomics.load(st, FN), atomics.load(st, DATA), atomics.load(st, PARTS)
        claimed = atomics.load(st, CLAIMED)
        if atomics.load(st, GEN) == gen:
            return gen, fn, data, parts, claimed


@njit
def _claim_parts(st, gen, fn, data, parts):
    """Run parts of job ``gen`` while some are unclaimed; stop if it is no longer the job."""
    while True:
        word = atomics.load(st, CLAIM)
        part = word & ((1 << PART_BITS) - 1)
        if word >> PART_BITS != gen or part >= parts:
            return
        if atomics.swap_if(st, CLAIM, word, word + 1):
            if _call_part(fn, data, part, parts):
                atomics.store(st, FAILED, 1)
            atomics.add(st, DONE, 1)


@intrinsic
def _start_threads(typingctx, state, first, last):
    """pthread_create helpers first..last-1 on ``state`` (kept alive by its owner):
    how many of them started, counted from ``first`` up to the first that did not."""

    def codegen(context, builder, sig, args):
        mod = builder.module
        entry_ty = ir.FunctionType(_I8P, [_I8P])
        entry = mod.globals.get("edgepack_pool_helper")
        if entry is None:  # void *entry(void *{state address, helper number})
            entry = ir.Function(mod, entry_ty, "edgepack_pool_helper")
            entry.linkage = "internal"
            eb = ir.IRBuilder(entry.append_basic_block())
            pair = eb.bitcast(entry.args[0], _I64.as_pointer())
            st = eb.load(pair)
            me = eb.load(eb.gep(pair, [ir.Constant(_I32, 1)]))
            life = types.void(types.int64, types.int64)
            loop = context.compile_subroutine(eb, _helper.py_func, life)
            context.call_internal_no_propagate(eb, loop.fndesc, life, [st, me])
            eb.ret(ir.Constant(_I8P, None))
        malloc = cgutils.get_or_insert_function(mod, ir.FunctionType(_I8P, [_I64]), "malloc")
        create = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_I32, [_I64.as_pointer(), _I8P, entry_ty.as_pointer(), _I8P]),
            "pthread_create",
        )
        addr = builder.ptrtoint(
            context.make_array(sig.args[0])(context, builder, value=args[0]).data, _I64
        )
        started = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
        tid = cgutils.alloca_once(builder, _I64)
        one = ir.Constant(_I64, 1)
        with cgutils.for_range_slice(builder, args[1], args[2], one, inc=True) as (i, _):
            pair = builder.call(malloc, [ir.Constant(_I64, 16)])
            pair = builder.bitcast(pair, _I64.as_pointer())
            builder.store(addr, pair)
            builder.store(i, builder.gep(pair, [ir.Constant(_I32, 1)]))
            null = ir.Constant(_I8P, None)  # default attributes
            rc = builder.call(create, [tid, null, entry, builder.bitcast(pair, _I8P)])
            # counted while every helper before it started too: a job's parts are
            # numbered 0..n-1, so a gap would leave a part nobody runs
            n = builder.load(started)
            ok = builder.and_(
                builder.icmp_signed("==", rc, ir.Constant(_I32, 0)),
                builder.icmp_signed("==", n, builder.sub(i, args[1])),
            )
            builder.store(builder.add(n, builder.zext(ok, _I64)), started)
        return builder.load(started)

    return types.int64(state, types.int64, types.int64), codegen


@njit(nogil=True)
def pool_start(state, threads):
    """Start helpers until ``threads`` run (caller included), up to MAX_THREADS."""
    have = max(1, atomics.load(state, STARTED))
    want = min(threads, MAX_THREADS)
    if want > have:
        got = _start_threads(state, have, want)
        atomics.store(state, STARTED, have + got)


def _kernel_flags():
    """Compiler flags for a kernel compiled inside a launcher: numba's defaults for a
    subroutine (NRT as the caller has it), with the JIT kernels' numpy error model
    (jit.py): without it every float division carries a zero check that keeps LLVM
    from vectorising the loop around it."""
    from numba.core import compiler, targetconfig

    flags = compiler.Flags()
    stack = targetconfig.ConfigStack()
    if stack:
        top = stack.top()
        if top.is_set("nrt") and top.nrt:
            flags.nrt = True
    flags.error_model = ERROR_MODEL
    return flags


def _unowned(context, builder, ty, value):
    """An array argument as a part sees it: the same view without its meminfo.

    Every part shares the caller's arrays, and a kernel compiled with NRT increments
    and decrements an array's reference count wherever its IR copies the array (an
    inlined helper's parameters, a row view): atomic adds on one cache line that each
    core took from the other. The int8 GEMV's 4-row tile (one helper call per weight
    row) ran 2.99 ms at one part and 2.79 at two on 49152 x 576 x 4 rows; Python
    threads running the same parts scaled, each with a meminfo of its own from
    unboxing. The caller keeps the arrays alive until every part is done, and NRT
    skips a null meminfo."""
    if not isinstance(ty, types.Array):
        return value
    ary = context.make_array(ty)(context, builder, value=value)
    ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
    return ary._getvalue()


def _launch_intrinsic(spmd_py):
    """The intrinsic that runs ``spmd_py``: _launch(state, argument tuple, parts) runs
    it whole on this thread for parts = 1 (raising as the kernel does), else on the
    pool (the lock taken by ``take``), and whole again if a part failed."""

    @intrinsic
    def _launch(typingctx, state, tup, parts):
        def codegen(context, builder, sig, args):
            st_ty, tup_ty, _ = sig.args
            n = len(tup_ty.types)
            spmd_sig = types.void(*tup_ty.types, types.int64, types.int64, st_ty)
            kern = context.compile_subroutine(builder, spmd_py, spmd_sig, flags=_kernel_flags())
            mod = builder.module
            pack_ty = ir.LiteralStructType([args[1].type, args[0].type])
            # the part function: unpack the arguments, run one part
            fn = ir.Function(mod, _PART_FN, mod.get_unique_name(f"{spmd_py.__name__}.part"))
            fn.linkage = "internal"
            pb = ir.IRBuilder(fn.append_basic_block())
            pk = pb.load(pb.bitcast(fn.args[0], pack_ty.as_pointer()))
            tv = pb.extract_value(pk, 0)
            items = [_unowned(context, pb, ty, pb.extract_value(tv, i))
                     for i, ty in enumerate(tup_ty.types)]  # fmt: skip
            status, _ = context.call_internal_no_propagate(
                pb, kern.fndesc, spmd_sig, [*items, fn.args[1], fn.args[2], pb.extract_value(pk, 1)]
            )
            pb.ret(pb.zext(status.is_error, _I32))

            def whole():  # on this thread; an error propagates as the kernel's own
                own = [builder.extract_value(args[1], i) for i in range(n)]
                one = [ir.Constant(_I64, 0), ir.Constant(_I64, 1)]
                context.call_internal(builder, kern.fndesc, spmd_sig, [*own, *one, args[0]])

            split = builder.icmp_signed(">", args[2], ir.Constant(_I64, 1))
            with builder.if_else(split) as (pooled, alone):
                with pooled:
                    # the job: the packed arguments on this stack, live until all parts end
                    slot = cgutils.alloca_once(builder, pack_ty)
                    pack = builder.insert_value(ir.Constant(pack_ty, ir.Undefined), args[1], 0)
                    builder.store(builder.insert_value(pack, args[0], 1), slot)
                    failed = _run(context, builder, st_ty, args[0], fn, slot, args[2],
                                  not spmd_py.parts_wait)
                    with builder.if_then(builder.icmp_signed("!=", failed, ir.Constant(_I64, 0))):
                        whole()
                with alone:
                    whole()
            return context.get_dummy_value()

        return types.void(state, tup, types.int64), codegen

    return _launch


def _run_job(st, fn, data, parts, claimed):
    """Publish the job, run part 0 (and, claimed, every part no helper took first), wait
    for the rest, give the pool back: whether a part failed."""
    gen = atomics.load(st, GEN) + 2  # even: published; odd while being written
    atomics.store(st, GEN, gen - 1)
    atomics.store(st, FN, fn)
    atomics.store(st, DATA, data)
    atomics.store(st, PARTS, parts)
    atomics.store(st, CLAIMED, claimed)
    atomics.store(st, DONE, 0)
    atomics.store(st, FAILED, 0)
    atomics.store(st, CLAIM, (gen << PART_BITS) | 1)  # part 0 is the caller's
    atomics.store(st, GEN, gen)
    for i in range(1, parts):
        t = TICKETS + 8 * i
        atomics.add(st, t, 1)
        if atomics.load(st, t + 1):
            atomics.futex(st, t, atomics.FUTEX_WAKE, 1)
    failed = _call_part(fn, data, 0, parts)
    atomics.add(st, DONE, 1)
    if claimed:
        _claim_parts(st, gen, fn, data, parts)
    spins = 0
    while atomics.load(st, DONE) < parts:  # a helper's part still running
        spins += 1
        if spins < WAIT_SPIN:
            atomics.pause()
        else:  # its thread may be waiting for this core
            atomics.yield_cpu()
    failed |= atomics.load(st, FAILED)
    atomics.store(st, LOCK, 0)  # taken by ``take``
    return failed


def _run(context, builder, st_ty, state, fn, slot, parts, claimed: bool):
    addr = builder.ptrtoint(context.make_array(st_ty)(context, builder, value=state).data, _I64)
    sig = types.int64(types.int64, types.int64, types.int64, types.int64, types.int64)
    job = context.compile_subroutine(builder, _run_job, sig)
    ptrs = [addr, builder.ptrtoint(fn, _I64), builder.ptrtoint(slot, _I64), parts,
            ir.Constant(_I64, int(claimed))]  # fmt: skip
    return context.call_internal(builder, job.fndesc, sig, ptrs)


@njit
def take(state):
    """The parts this call may use: 1 when the pool is busy (run whole, lock not taken)."""
    parts = min(atomics.load(state, WANT), atomics.load(state, STARTED))
    if parts <= 1 or not atomics.swap_if(state, LOCK, 0, 1):
        return 1
    return parts


def launcher(kernel):
    """A parallel kernel's AOT entry: the pool state (int64[STATE_LEN]), then the
    kernel's arguments. Runs the SPMD form on the pool's threads (module doc)."""
    py = kernel.py_func
    spmd_py = spmd_function(py)
    params = [a for a in inspect.signature(py).parameters]
    names = ", ".join(params)
    src = f"def {py.__name__}(_state, {names}):\n    launch(_state, ({names},), take(_state))\n"
    scope = {"take": take, "launch": _launch_intrinsic(spmd_py)}
    exec(compile(src, f"<launcher {py.__module__}.{py.__name__}>", "exec"), scope)  # noqa: S102
    out = scope[py.__name__]
    out.__qualname__ = f"{py.__name__}_launcher"
    return out
