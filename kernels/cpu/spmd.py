"""Parallel loops without numba's threading layer: each parallel kernel as an SPMD function.

numba's ahead-of-time compiler (pycc) has no parallel loops: a ``prange`` compiles as
a plain ``range`` and the device executable ran every kernel on one core. Here the
same kernel source becomes a function every thread of a small pool calls at once
(kernels/cpu/native_pool.py), each with its part number:

- each ``for i in prange(lo, hi)`` walks only the part's contiguous share of lo..hi
  (``n * part // parts`` to ``n * (part + 1) // parts``: prange's own static split);
- a barrier follows a parallel loop when anything comes after it (wino_conv's five
  phases per block read what the phase before wrote);
- a serial statement that writes memory (a call made for its effect, a store into an
  array) runs in part 0 only, and the next parallel loop waits for it behind a
  barrier (the KV-cache stores before attention, the rows quantized before the int4
  GEMV, the bias pass after the GEMV). Serial statements that only compute locals run
  in every part: each part needs them.

Iterations of a parallel loop are independent (prange requires it), so any split
gives bit-identical results; tests/test_spmd.py launches them on the pool under the
JIT against the serial kernels. The AOT build (packager/aot.py) exports every
parallel kernel in this form, behind a launcher.

The barrier spins on an atomic counter in ``sync`` (int64[2]: arrivals, generation)
and yields the CPU after ``SPINS`` polls: a futex wake costs ~10-50 us on these VMs,
a kernel call in MobileNetV2 ~40 us.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from . import atomics
from .jit import njit

PART_ARGS = ("_part", "_parts", "_sync")
SPINS = 20000  # polls before a waiting part yields its core to others


@njit
def barrier(sync, parts):
    """Wait until all ``parts`` callers have arrived (a generation barrier on sync[0:2])."""
    if parts <= 1:
        return
    gen = atomics.load(sync, 1)
    if atomics.add(sync, 0, 1) == parts - 1:  # the last to arrive opens it
        atomics.store(sync, 0, 0)
        atomics.add(sync, 1, 1)
        return
    spins = 0
    while atomics.load(sync, 1) == gen:
        spins += 1
        if spins > SPINS:
            atomics.yield_cpu()
        else:
            atomics.pause()


class NotSplittable(ValueError):
    """A parallel kernel the SPMD form cannot take as written (the message says why)."""


def _is_prange(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.For)
        and isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Name)
        and node.iter.func.id == "prange"
    )


def _has_prange(node: ast.AST) -> bool:
    return any(_is_prange(n) for n in ast.walk(node))


def _writes(node: ast.AST) -> bool:
    """Whether a statement may write memory: an array store, or a call made for its effect."""
    for n in ast.walk(node):
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call):
            return True
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
            return True
    return False


def _names(node: ast.AST, ctx: type) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _stmt(src: str) -> ast.stmt:
    return ast.parse(src).body[0]


class _Splitter:
    def __init__(self, name: str):
        self.name, self.loops, self.barriers = name, 0, 0

    def barrier(self) -> ast.stmt:
        self.barriers += 1
        return _stmt("barrier(_sync, _parts)")

    def block(self, stmts: list[ast.stmt], top: bool) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        dirty = False  # part 0 wrote memory that the next parallel loop may read
        for i, s in enumerate(stmts):
            rest = stmts[i + 1 :]
            if _is_prange(s):
                if dirty:
                    out.append(self.barrier())
                    dirty = False
                out.extend(self.loop(s))
                if rest or not top:  # later statements (or the next pass) read its writes
                    out.append(self.barrier())
            elif _has_prange(s):
                if dirty:
                    out.append(self.barrier())
                    dirty = False
                if not isinstance(s, (ast.For, ast.While, ast.If)):
                    raise NotSplittable(f"{self.name}: a prange inside {type(s).__name__}")
                s.body = self.block(s.body, False)
                s.orelse = self.block(s.orelse, False)
                out.append(s)
            elif _writes(s):
                # names later code reads without binding them itself (an approximation
                # of liveness: the kernels' loop locals are bound again where used)
                later = ast.Module(rest, [])
                shared = _names(s, ast.Store) & (_names(later, ast.Load) - _names(later, ast.Store))
                if shared:
                    raise NotSplittable(
                        f"{self.name} line {s.lineno}: a serial statement that writes memory "
                        f"also sets {sorted(shared)}, used later by every part"
                    )
                out.append(ast.If(_stmt("_part == 0").value, [s], []))
                dirty = True
            else:
                out.append(s)
        if dirty and not top:  # a loop's next pass may read what part 0 wrote
            out.append(self.barrier())
        return out

    def loop(self, s: ast.For) -> list[ast.stmt]:
        body = ast.Module(s.body, [])
        private = {
            t.id
            for n in ast.walk(body)
            if isinstance(n, (ast.Assign, ast.For))
            for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(body):  # numba sums these across threads; a part cannot
            if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                if n.target.id not in private:
                    raise NotSplittable(f"{self.name}: prange reduction into {n.target.id!r}")
        args = s.iter.args
        if s.iter.keywords or len(args) not in (1, 2):
            raise NotSplittable(f"{self.name}: prange takes (stop) or (start, stop) here")
        k, self.loops = self.loops, self.loops + 1
        lo = ast.unparse(args[0]) if len(args) == 2 else "0"
        hi = ast.unparse(args[-1])
        head = [
            _stmt(f"_lo{k} = {lo}"),
            _stmt(f"_n{k} = max(0, ({hi}) - _lo{k})"),
        ]
        s.iter = _stmt(
            f"range(_lo{k} + _n{k} * _part // _parts, _lo{k} + _n{k} * (_part + 1) // _parts)"
        ).value
        return [*head, s]


def spmd_source(fn) -> tuple[str, str]:
    """(name, source) of ``fn``'s SPMD form (a plain function: decorators dropped), for
    the Python function behind a numba dispatcher. Raises NotSplittable."""
    name, src, _ = _split(fn)
    return name, src


def _split(fn) -> tuple[str, str, int]:
    """spmd_source's (name, source), and how many barriers that source has."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    f = tree.body[0]
    if not isinstance(f, ast.FunctionDef):
        raise NotSplittable(f"{fn.__name__}: not a plain function")
    f.decorator_list = []
    sp = _Splitter(f.name)
    f.args.args += [ast.arg(a) for a in PART_ARGS]
    f.body = sp.block(f.body, True)
    if not sp.loops:
        raise NotSplittable(f"{f.name}: no prange loop")
    return f.name, ast.unparse(ast.fix_missing_locations(tree)), sp.barriers


def spmd_function(fn):
    """``fn`` (a parallel kernel's Python function) in SPMD form: its arguments, then
    ``_part, _parts, _sync`` (module doc). Compiled by whoever takes it (njit or pycc);
    it sees the kernel module's globals, and ``barrier``. Its ``parts_wait`` says
    whether its parts meet at barriers (then each part needs a thread of its own;
    without, one thread may run several parts one after another: native_pool.py)."""
    name, src, barriers = _split(fn)
    scope = dict(fn.__globals__)
    scope["barrier"] = barrier
    code = compile(src, f"<spmd {fn.__module__}.{name}>", "exec")
    exec(code, scope)  # noqa: S102 - our own kernel source, rewritten
    out = scope[name]
    out.__qualname__ = f"{name}_spmd"
    out.parts_wait = barriers > 0
    return out
