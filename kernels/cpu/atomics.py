"""Atomic int64 operations, a spin-wait hint and futexes for numba kernels.

What the SPMD barrier (spmd.py) and the native kernel pool (native_pool.py) are built
from. Each operation takes an int64 array or a raw address (an int64: the pool's
worker threads start with a bare pointer) and an element index. Loads acquire, stores
release, read-modify-writes are sequentially consistent: a waiter that announces
itself (``add``) and then re-reads never misses a ``store`` + wake of the other side.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _elem_ptr

_I32, _I64 = ir.IntType(32), ir.IntType(64)
# futex(2) numbers (asm-generic is aarch64's), private to the process
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
FUTEX_WAIT, FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE


def _ptr(context, builder, ty, val, idx, idxty):
    if isinstance(ty, types.Array):
        return _elem_ptr(context, builder, ty, val, idx, idxty)
    base = builder.inttoptr(val, _I64.as_pointer())
    return builder.gep(base, [context.cast(builder, idx, idxty, types.intp)])


def _arch(builder) -> str:
    return builder.module.triple.split("-")[0]


@intrinsic
def load(typingctx, where, idx):
    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load_atomic(p, "acquire", 8)

    return types.int64(where, idx), codegen


@intrinsic
def store(typingctx, where, idx, val):
    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, p, "release", 8)
        return context.get_dummy_value()

    return types.void(where, idx, val), codegen


@intrinsic
def add(typingctx, where, idx, val):
    """where[idx] += val; the value before."""

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, v, "seq_cst")

    return types.int64(where, idx, val), codegen


@intrinsic
def swap_if(typingctx, where, idx, old, new):
    """where[idx] = new if it holds old; whether it did."""

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(p, o, n, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(where, idx, old, new), codegen


@intrinsic
def pause(typingctx):
    """The CPU's spin-wait hint (x86 ``pause``, aarch64 ``yield``): a poll loop then
    leaves the core's other thread and the memory bus alone."""

    def codegen(context, builder, sig, args):
        arch = _arch(builder)
        if arch == "x86_64":
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        elif arch == "aarch64":
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_I32]), "llvm.aarch64.hint"
            )
            builder.call(fn, [ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def futex(typingctx, where, idx, op, val):
    """futex(2) on the low 32 bits of where[idx] (little-endian: its first four bytes):
    FUTEX_WAIT sleeps while they equal ``val``; FUTEX_WAKE wakes up to ``val`` sleepers."""

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        fnty = ir.FunctionType(_I64, [_I64], var_arg=True)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
        nr = ir.Constant(_I64, SYS_FUTEX[_arch(builder)])
        op_ = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), _I32)
        v = builder.trunc(context.cast(builder, args[3], sig.args[3], types.int64), _I32)
        null = ir.Constant(_I64, 0)
        return builder.call(fn, [nr, builder.ptrtoint(p, _I64), op_, v, null, null, null])

    return types.int64(where, idx, op, val), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(2): libc's, linked into the JIT process and the AOT extension alike."""

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_I32, [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_yield"), [])
        return context.get_dummy_value()

    return types.void(), codegen
