"""The dtype-generic kernels, written once over an array module: NumPy for the cpu
backend, CuPy (or NumPy under the CUDA simulator) for the cuda one. Each ``*_step``
takes the module as ``xp`` and the node's bound views, and returns the step that
writes the output in place (ufuncs with ``out=``: no allocation per run).

These ops move, compare and select tensors of any arena dtype (indices, masks, token
ids; kernels/ops.py GENERIC_OPS), and the reductions a fixed-function ufunc does best.
"""

from __future__ import annotations

import numpy as np

from .ops import slice_index

# the ops generic_step runs (each backend binds the other move ops itself)
STEP_OPS = ("expand", "cast", "compare", "logic", "where", "take", "gather_elements", "topk",
            "cumsum", "scatter_elements", "gather_nd", "scatter_nd", "pool_nd",
            "grid_sample")  # fmt: skip
_REDUCE_PRE = {"l1": "abs", "l2": "square", "sum_square": "square", "log_sum_exp": "exp"}


def reduce_scratch_floats(kind: str, x_size: int, y_size: int) -> int:
    """float32 scratch a reduce node needs: |x|, x² or exp(x - max) (x's size), and for
    log_sum_exp the max as well (the output's size)."""
    if kind not in _REDUCE_PRE:
        return 0
    return x_size + (y_size if kind == "log_sum_exp" else 0)


def reduce_step(xp, x, y, scratch, attrs: dict):
    """reduce's step for either backend (``xp``: NumPy or the GPU's array module, and
    ``scratch`` a float32 array of reduce_scratch_floats): the fold into the output
    view, in place, no allocation per run."""
    kind = attrs["kind"]
    axes = tuple(a % x.ndim for a in attrs["axes"])
    kept = [1 if i in axes else d for i, d in enumerate(x.shape)]
    yk = y.reshape(kept)
    fold = {"max": xp.maximum, "min": xp.minimum, "prod": xp.multiply}.get(kind, xp.add)
    n = float(np.prod([x.shape[a] for a in axes]))
    tmp = scratch[: x.size].reshape(x.shape) if kind in _REDUCE_PRE else None
    mx = scratch[x.size : x.size + y.size].reshape(kept) if kind == "log_sum_exp" else None

    def step() -> None:
        src = x
        if kind == "log_sum_exp":  # max + log(sum(exp(x - max))): no overflow
            xp.maximum.reduce(x, axis=axes, keepdims=True, out=mx)
            xp.subtract(x, mx, out=tmp)
            xp.exp(tmp, out=tmp)
            src = tmp
        elif tmp is not None:
            getattr(xp, _REDUCE_PRE[kind])(x, out=tmp)
            src = tmp
        fold.reduce(src, axis=axes, keepdims=True, out=yk)
        if kind == "mean":
            xp.multiply(yk, np.float32(1.0 / n), out=yk)
        elif kind == "l2":
            xp.sqrt(yk, out=yk)
        elif kind in ("log_sum", "log_sum_exp"):
            xp.log(yk, out=yk)
            if kind == "log_sum_exp":
                xp.add(yk, mx, out=yk)

    return step


def argmax_step(xp, x, y, attrs: dict):
    """argmax's step for either backend: ``xp`` (NumPy, or the GPU's array module)
    writes the indices into the output view, in place (no allocation per run)."""
    ax = int(attrs["axis"])
    f = xp.argmin if attrs.get("min") else xp.argmax
    last = bool(attrs.get("select_last"))
    src = x[(slice(None),) * ax + (slice(None, None, -1),)] if last else x
    yk = y.reshape(tuple(d for i, d in enumerate(x.shape) if i != ax))
    top = x.shape[ax] - 1

    def step() -> None:
        f(src, axis=ax, out=yk)
        if last:  # the reversed view's first is the last
            xp.subtract(top, yk, out=yk)

    return step


def cast_step(xp, x, y):
    """Cast: float to integer truncates toward zero, to bool is "not zero" (NaN: True),
    as ONNX's Cast."""
    return lambda: xp.copyto(y, x, casting="unsafe")


_COMPARE = {"equal": "equal", "less": "less", "less_equal": "less_equal",
            "greater": "greater", "greater_equal": "greater_equal"}  # fmt: skip
_LOGIC = {"and": "logical_and", "or": "logical_or", "xor": "logical_xor", "not": "logical_not"}
_INT_BINARY = {"add": "add", "sub": "subtract", "mul": "multiply", "max": "maximum",
               "min": "minimum", "mod": "mod", "fmod": "fmod", "pow": "power",
               "bit_and": "bitwise_and", "bit_or": "bitwise_or",
               "bit_xor": "bitwise_xor"}  # fmt: skip


def compare_step(xp, a, b, y, kind: str):
    f = getattr(xp, _COMPARE[kind])
    return lambda: f(a, b, out=y)


def logic_step(xp, a, b, y, kind: str):
    f = getattr(xp, _LOGIC[kind])
    if kind == "not":
        return lambda: f(a, out=y)
    return lambda: f(a, b, out=y)


def int_binary_step(xp, a, b, y, kind: str):
    """binary on integer tensors (wrapping as the dtype does, as ONNX Runtime); div
    truncates toward zero: (a - fmod(a, b)) // b, exact, the remainder in a buffer of
    its own (made here, once) since the planner may write y over a."""
    if kind == "div":
        r = xp.empty(y.shape, y.dtype)

        def step() -> None:
            xp.fmod(a, b, out=r)
            xp.subtract(a, r, out=r)
            xp.floor_divide(r, b, out=y)

        return step
    f = getattr(xp, _INT_BINARY[kind])
    return lambda: f(a, b, out=y)


def where_step(xp, cond, a, b, y):
    c, av, bv = (xp.broadcast_to(t, y.shape) for t in (cond, a, b))

    def step() -> None:
        xp.copyto(y, bv)
        xp.copyto(y, av, where=c)

    return step


def expand_step(xp, x, y):
    src = xp.broadcast_to(x, y.shape)
    return lambda: xp.copyto(y, src)


def _check_index(xp, flat, n: int, what: str) -> None:
    if flat.size and (int(flat.min()) < -n or int(flat.max()) >= n):
        raise IndexError(f"{what}: an index outside an axis of {n}")


def take_step(xp, x, idx, y, axis: int):
    """Gather along ``axis`` at run-time (or constant) indices; negative ones count from
    the end; one outside the axis is an error, checked every run."""
    n = x.shape[axis]
    kw = {"mode": "wrap"} if xp is np else {}  # checked below; wrap maps -1 to n - 1
    flat = idx.reshape(-1)

    def step() -> None:
        _check_index(xp, flat, n, "Gather")
        xp.take(x, idx, axis=axis, out=y, **kw)

    return step


def gather_elements_step(xp, x, idx, y, axis: int):
    """GatherElements as one flat take: the flat offset of each output element is
    (its index mod n) * x's stride along ``axis`` + the offset of its other coordinates
    (a table made here, once); the offsets go to a buffer of their own, no allocation
    per run."""
    if not x.flags.c_contiguous:
        raise ValueError("gather_elements reads a contiguous tensor")
    n = x.shape[axis]
    stride = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    coords = np.indices(idx.shape, dtype=np.int64)
    coords[axis] = 0
    base = xp.asarray(np.ravel_multi_index(tuple(coords), x.shape).astype(np.int64))
    off = xp.empty(idx.shape, np.int64)
    src, flat = x.reshape(-1), idx.reshape(-1)

    def step() -> None:
        _check_index(xp, flat, n, "GatherElements")
        xp.mod(idx, n, out=off)  # in range after the check: -1 is n - 1
        xp.multiply(off, stride, out=off)
        xp.add(off, base, out=off)
        xp.take(src, off, out=y)

    return step


_SCATTER_UFUNC = {"add": "add", "mul": "multiply", "max": "maximum", "min": "minimum"}


def _scatter(xp, dst, at, values, reduction: str) -> None:
    """dst[at] = values (the last of repeated ``at`` wins on NumPy), or combined with
    ``reduction`` through the ufunc's unbuffered ``at`` (every repeat counts). CuPy's
    ufunc.at takes add, max and min; mul is NumPy's (the CUDA simulator's) only."""
    if reduction == "none":
        dst[at] = values
    else:
        getattr(xp, _SCATTER_UFUNC[reduction]).at(dst, at, values)


def scatter_elements_step(xp, x, idx, upd, y, attrs: dict):
    """ScatterElements: y = x, then each update at the flat offset of its element with
    its coordinate along ``axis`` replaced by its index (a table of the other
    coordinates' offsets made here, once; the offsets in a buffer of their own)."""
    ax, reduction = int(attrs["axis"]), attrs["reduction"]
    n = x.shape[ax]
    stride = int(np.prod(x.shape[ax + 1 :], dtype=np.int64))
    coords = np.indices(idx.shape, dtype=np.int64)
    coords[ax] = 0
    base = xp.asarray(np.ravel_multi_index(tuple(coords), x.shape).astype(np.int64))
    off = xp.empty(idx.shape, np.int64)
    dst, flat, vals = y.reshape(-1), idx.reshape(-1), upd.reshape(-1)

    def step() -> None:
        _check_index(xp, flat, n, "ScatterElements")
        xp.copyto(y, x)
        xp.mod(idx, n, out=off)
        xp.multiply(off, stride, out=off)
        xp.add(off, base, out=off)
        _scatter(xp, dst, off.reshape(-1), vals, reduction)

    return step


def _nd_rows_step(xp, x_shape, idx, b: int, what: str):
    """(step writing, for each index tuple of GatherND / ScatterND, its row of x viewed
    as [rows, inner], the rows buffer, inner): the tuple's coordinates wrapped and
    dotted with their strides, plus the batch offset (a table made here, once)."""
    k = idx.shape[-1]
    dims = np.asarray(x_shape[b : b + k], np.int64)
    strides = np.asarray([int(np.prod(dims[j + 1 :])) for j in range(k)], np.int64)
    batch = np.indices(idx.shape[:b], dtype=np.int64) if b else None
    base = np.zeros(idx.shape[:-1], np.int64)
    if b:
        flat_b = np.ravel_multi_index(tuple(batch), idx.shape[:b]) * int(np.prod(dims))
        base += flat_b.reshape(flat_b.shape + (1,) * (idx.ndim - 1 - b))
    base, dims_x, strides_x = xp.asarray(base), xp.asarray(dims), xp.asarray(strides)
    tmp, rows = xp.empty(idx.shape, np.int64), xp.empty(idx.shape[:-1], np.int64)
    lead = tuple(range(idx.ndim - 1))

    def step() -> None:
        if idx.size and (bool((idx.min(axis=lead) < -dims_x).any())
                         or bool((idx.max(axis=lead) >= dims_x).any())):  # fmt: skip
            raise IndexError(f"{what}: an index outside an axis")
        xp.mod(idx, dims_x, out=tmp)
        xp.multiply(tmp, strides_x, out=tmp)
        xp.sum(tmp, axis=-1, out=rows)
        xp.add(rows, base, out=rows)

    return step, rows, int(np.prod(x_shape[b + k :], dtype=np.int64))


def gather_nd_step(xp, x, idx, y, attrs: dict):
    b = int(attrs["batch_dims"])
    index, rows, inner = _nd_rows_step(xp, x.shape, idx, b, "GatherND")
    src = x.reshape(-1, inner)
    dst = y.reshape(rows.shape + (inner,))

    def step() -> None:
        index()
        xp.take(src, rows, axis=0, out=dst)

    return step


def scatter_nd_step(xp, x, idx, upd, y, attrs: dict):
    index, rows, inner = _nd_rows_step(xp, x.shape, idx, 0, "ScatterND")
    dst, vals = y.reshape(-1, inner), upd.reshape(-1, inner)
    flat = rows.reshape(-1)

    def step() -> None:
        index()
        xp.copyto(y, x)
        _scatter(xp, dst, flat, vals, attrs["reduction"])

    return step


def pool_nd_step(xp, x, y, attrs: dict):
    """N-D pooling as one reduction over a strided window view of a padded copy of x
    (the copy, made here once, holds -inf or 0 in its pads and the ceil_mode margin;
    each run copies x into its interior). The mean divides by a table of each
    window's counted taps, made here from the same view over a mask."""
    k, s, d, out = attrs["kernel"], attrs["strides"], attrs["dilations"], attrs["out"]
    nd, pads, kind = len(k), attrs["pads"], attrs["kind"]
    sp = x.shape[2:]
    # the padded extent: every tap of every window inside it
    ext = [max(sp[i] + pads[i] + pads[nd + i], (out[i] - 1) * s[i] + (k[i] - 1) * d[i] + 1)
           for i in range(nd)]  # fmt: skip
    fill = -np.inf if kind == "max" else 0.0
    buf = xp.full((*x.shape[:2], *ext), fill, np.float32)
    inner = buf[(slice(None), slice(None), *(slice(pads[i], pads[i] + sp[i]) for i in range(nd)))]

    def windows(a):
        st = a.strides
        return xp.lib.stride_tricks.as_strided(
            a, (*a.shape[:2], *out, *k),
            (*st[:2], *(st[2 + i] * s[i] for i in range(nd)),
             *(st[2 + i] * d[i] for i in range(nd))))  # fmt: skip

    view, axes = windows(buf), tuple(range(2 + nd, 2 + 2 * nd))
    if kind.startswith("argmax"):
        return _pool_argmax_step(xp, x, y, inner, view, windows, ext, pads, sp,
                                 kind == "argmax_col")  # fmt: skip
    count = None
    if kind == "avg":  # taps inside x, or inside x and its explicit pads
        m = np.zeros((1, 1, *ext), np.float32)
        lim = [sp[i] + (pads[i] + pads[nd + i] if attrs["count_include_pad"] else 0)
               for i in range(nd)]  # fmt: skip
        lo = [0 if attrs["count_include_pad"] else pads[i] for i in range(nd)]
        m[(0, 0, *(slice(lo[i], lo[i] + lim[i]) for i in range(nd)))] = 1.0
        count = xp.asarray(windows(m).sum(axis=axes, dtype=np.float32))
    p = float(attrs.get("p", 2))

    def step() -> None:
        xp.copyto(inner, x)
        if kind == "max":
            xp.max(view, axis=axes, out=y)
            return
        if kind == "lp":
            xp.abs(inner, out=inner)
            if p != 1.0:
                xp.power(inner, np.float32(p), out=inner)
        xp.sum(view, axis=axes, out=y)
        if kind == "avg":
            xp.divide(y, count, out=y)
        elif p != 1.0:
            xp.power(y, np.float32(1.0 / p), out=y)

    return step


def _pool_argmax_step(xp, x, y, inner, view, windows, ext, pads, sp, col: bool):
    """MaxPool's Indices: one pass per tap of the window, keeping the largest value so
    far and its flat index into x (a table of the padded buffer's positions, -1 in the
    pads, made here once); strictly larger replaces, so the first maximum wins."""
    nd = len(sp)
    table = np.full((*x.shape[:2], *ext), -1, np.int64)
    n_sp = int(np.prod(sp, dtype=np.int64))
    spatial = np.arange(n_sp, dtype=np.int64).reshape(sp, order="F" if col else "C")
    planes = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(*x.shape[:2], *[1] * nd)
    table[(slice(None), slice(None), *(slice(pads[i], pads[i] + sp[i]) for i in range(nd)))] = (
        planes * n_sp + spatial)
    at = windows(xp.asarray(table))
    k = view.shape[2 + nd :]
    best = xp.empty(y.shape, np.float32)
    take, unset = xp.empty(y.shape, bool), xp.empty(y.shape, bool)
    taps = [(view[(Ellipsis, *t)], at[(Ellipsis, *t)], xp.asarray(at[(Ellipsis, *t)] >= 0))
            for t in np.ndindex(*k)]  # fmt: skip

    def step() -> None:
        xp.copyto(inner, x)
        best.fill(-np.inf)
        y.fill(-1)
        for v, i, valid in taps:
            xp.greater(v, best, out=take)
            xp.less(y, 0, out=unset)
            xp.logical_or(take, unset, out=take)  # the first tap inside x starts it
            xp.logical_and(take, valid, out=take)
            xp.copyto(best, v, where=take)
            xp.copyto(y, i, where=take)

    return step


def topk_step(xp, x, y, attrs: dict):
    """TopK's indices along ``axis``: a stable sort of x (negated for the largest: -x
    for floats, ~x for integers, exact), its first k. The sort allocates its order per
    run (NumPy's argsort has no ``out``); YOLO26's head sorts 8400 and 24000 scores:
    0.5 and 2.1 ms here, 1 thread. CuPy's argsort is a stable radix sort as well."""
    ax, k, largest = int(attrs["axis"]), int(attrs["k"]), bool(attrs["largest"])
    key = xp.empty(x.shape, x.dtype) if largest else x
    neg = xp.negative if x.dtype.kind == "f" else xp.invert
    head = (slice(None),) * ax + (slice(0, k),)
    kw = {"kind": "stable"} if xp is np else {}

    def step() -> None:
        if largest:
            neg(x, out=key)
        xp.copyto(y, xp.argsort(key, axis=ax, **kw)[head])

    return step


def cumsum_step(xp, x, y, attrs: dict):
    """CumSum into y in place: over reversed views for ``reverse``; ``exclusive`` sums
    all but the last element into y shifted one along the axis, and zeroes its first."""
    ax, n = int(attrs["axis"]), x.shape[int(attrs["axis"])]
    flip = (slice(None),) * ax + (slice(None, None, -1),)
    src, dst = (x[flip], y[flip]) if attrs.get("reverse") else (x, y)
    if not attrs.get("exclusive"):
        return lambda: xp.cumsum(src, axis=ax, out=dst)
    head, rest = (slice(None),) * ax + (slice(0, 1),), (slice(None),) * ax + (slice(1, n),)
    part = (slice(None),) * ax + (slice(0, n - 1),)

    def step() -> None:
        if n > 1:
            xp.cumsum(src[part], axis=ax, out=dst[rest])
        dst[head] = 0

    return step


def slice_step(xp, x, y, attrs: dict):
    src = x[slice_index(attrs)]
    return lambda: xp.copyto(y, src)


def generic_step(xp, op: str, ins, y, attrs: dict):
    """The step of a GENERIC_OPS node other than the move ops each backend binds."""
    if op == "expand":
        return expand_step(xp, ins[0], y)
    if op == "cast":
        return cast_step(xp, ins[0], y)
    if op == "compare":
        return compare_step(xp, ins[0], ins[1], y, attrs["kind"])
    if op == "logic":
        return logic_step(xp, ins[0], ins[1] if len(ins) > 1 else None, y, attrs["kind"])
    if op == "where":
        return where_step(xp, ins[0], ins[1], ins[2], y)
    if op == "take":
        return take_step(xp, ins[0], ins[1], y, int(attrs["axis"]))
    if op == "gather_elements":
        return gather_elements_step(xp, ins[0], ins[1], y, int(attrs["axis"]))
    if op == "topk":
        return topk_step(xp, ins[0], y, attrs)
    if op == "cumsum":
        return cumsum_step(xp, ins[0], y, attrs)
    if op == "scatter_elements":
        return scatter_elements_step(xp, ins[0], ins[1], ins[2], y, attrs)
    if op == "gather_nd":
        return gather_nd_step(xp, ins[0], ins[1], y, attrs)
    if op == "scatter_nd":
        return scatter_nd_step(xp, ins[0], ins[1], ins[2], y, attrs)
    if op == "pool_nd":
        return pool_nd_step(xp, ins[0], y, attrs)
    if op == "grid_sample":
        from .sampling import grid_sample_step

        return grid_sample_step(xp, ins[0], ins[1], y, attrs)
    raise ValueError(f"{op} is not a dtype-generic op")
