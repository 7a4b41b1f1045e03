"""ONNX ops lowered as compositions of other IR ops, each as ONNX's operator text
defines it: PRelu, Swish, Tile, CenterCropPad, the Bitwise ops, Pow across dtypes
and EyeLike.

None of these needs a kernel of its own: a composition of binaries, compares,
selects, broadcasts and reshapes runs on every backend and is checked by the kernels'
own tests. The handlers take the importer's context (packager/onnx_import.py
``_Ctx``) and need nothing else from the importer.
"""

from __future__ import annotations

import numpy as np

from ..runtime.bundle_format import TENSOR_DTYPES

_NO_ACT = {"act": "none", "act_args": [0.0, 0.0]}


def _bin(ctx, kind: str, a: str, b: str, out: str | None = None) -> str:
    return ctx.emit("binary", [a, b], out or ctx.fresh(f"{ctx.node_name}.{kind}"),
                    {"kind": kind, **_NO_ACT})  # fmt: skip


def _cast(ctx, x: str, to: str, out: str | None = None) -> str:
    return ctx.emit("cast", [x], out or ctx.fresh(f"{x}.{to}"), {"to": to})


def _dtype(ctx, name: str) -> str:
    if name in ctx.g.consts:
        from ..runtime.bundle_format import TENSOR_CODES

        return TENSOR_CODES[ctx.g.consts[name].dtype]
    return ctx.g.dtype(name)


def prelu(ctx, ins, outs, a):
    """PRelu: x where x >= 0, slope * x elsewhere (slope broadcast to x, a constant
    or a run-time tensor). NaN stays NaN (x < 0 is false for NaN)."""
    x, slope = ins[:2]
    if slope in ctx.g.consts and ctx.g.consts[slope].size == 1:  # leaky ReLU
        alpha = float(np.asarray(ctx.g.consts[slope], np.float32).reshape(-1)[0])
        ctx.emit("unary", [x], outs[0], {"act": "leaky_relu", "act_args": [alpha, 0.0]})
        return
    zero = ctx.add_const(ctx.fresh(ctx.node_name + ".zero"), np.zeros((), np.float32))
    neg = ctx.emit("compare", [x, zero], ctx.fresh(ctx.node_name + ".neg"), {"kind": "less"})
    ctx.emit("where", [neg, _bin(ctx, "mul", x, slope), x], outs[0], {})


def swish(ctx, ins, outs, a):
    """Swish (opset 24): x * sigmoid(alpha * x); alpha 1 is SiLU, one activation."""
    alpha = float(a.get("alpha", 1.0))
    if alpha == 1.0:
        ctx.emit("unary", [ins[0]], outs[0], {"act": "silu", "act_args": [0.0, 0.0]})
        return
    k = ctx.add_const(ctx.fresh(ctx.node_name + ".alpha"), np.float32(alpha))
    s = ctx.emit("unary", [_bin(ctx, "mul", ins[0], k)], ctx.fresh(ctx.node_name + ".sig"),
                 {"act": "sigmoid", "act_args": [0.0, 0.0]})  # fmt: skip
    _bin(ctx, "mul", ins[0], s, outs[0])


def tile(ctx, ins, outs, a):
    """Tile by constant repeats: x as [1, d0, 1, d1, ...] broadcast to
    [r0, d0, r1, d1, ...], then reshaped to [r0 * d0, r1 * d1, ...]."""
    xs = ctx.shape(ins[0])
    reps = [int(v) for v in np.asarray(ctx.const(ins[1], "repeats")).reshape(-1)]
    if len(reps) != len(xs) or min(reps, default=1) < 1:
        raise ctx.fail(f"repeats {reps} for a rank-{len(xs)} input (one >= 1 per axis)")
    if all(r == 1 for r in reps):
        ctx.emit("reshape", [ins[0]], outs[0], {"shape": list(xs)})
        return
    inter = [v for d in xs for v in (1, d)]
    big = [v for r, d in zip(reps, xs) for v in (r, d)]
    r = ctx.emit("reshape", [ins[0]], ctx.fresh(ins[0] + ".t"), {"shape": inter})
    e = ctx.emit("expand", [r], ctx.fresh(ins[0] + ".tiled"), {"shape": big})
    ctx.emit("reshape", [e], outs[0], {"shape": [r * d for r, d in zip(reps, xs)]})


def center_crop_pad(ctx, ins, outs, a):
    """CenterCropPad: each named axis cropped (a centred slice; an odd excess drops the
    extra element at the end) or zero-padded (the extra pad at the end) to its size."""
    xs = ctx.shape(ins[0])
    shape = [int(v) for v in np.asarray(ctx.const(ins[1], "shape")).reshape(-1)]
    axes = [int(v) % len(xs) for v in a.get("axes", range(len(xs)))]
    if len(shape) != len(axes):
        raise ctx.fail(f"shape {shape} for axes {axes}")
    starts, sizes, pads = [0] * len(xs), list(xs), [0] * (2 * len(xs))
    for ax, n in zip(axes, shape):
        d = xs[ax]
        if n < d:
            starts[ax], sizes[ax] = (d - n) // 2, n
        elif n > d:
            pads[ax], pads[ax + len(xs)] = (n - d) // 2, n - d - (n - d) // 2
    y = ins[0]
    if sizes != list(xs):
        y = ctx.emit("slice", [y], ctx.fresh(outs[0] + ".crop") if any(pads) else outs[0],
                     {"starts": starts, "steps": [1] * len(xs), "sizes": sizes})  # fmt: skip
    if any(pads):
        ctx.emit("pad", [y], outs[0], {"pads": pads, "mode": "constant", "value": 0.0})
    elif y == ins[0]:
        ctx.emit("reshape", [y], outs[0], {"shape": list(xs)})


def bitwise(kind: str):
    def handler(ctx, ins, outs, a):
        _bin(ctx, kind, ins[0], ins[1], outs[0])

    return handler


def bitwise_not(ctx, ins, outs, a):
    """BitwiseNot: x xor all-ones of its dtype."""
    dt = np.dtype(TENSOR_DTYPES[_dtype(ctx, ins[0])])
    if dt.kind not in "iu":
        raise ctx.fail(f"BitwiseNot of {dt}: integer tensors")
    ones = ctx.add_const(ctx.fresh(ctx.node_name + ".ones"), np.invert(np.zeros((), dt)))
    _bin(ctx, "bit_xor", ins[0], ones, outs[0])


def pow_(ctx, ins, outs, a):
    """Pow: y has the base's dtype. A float base with an integer exponent takes the
    exponent as float32 (exact below 2**24); an integer base with a float exponent
    is computed in float32 and cast back (truncating toward zero, as ORT's cast);
    integers to integer powers stay integers."""
    x, e = ins[:2]
    xd, ed = _dtype(ctx, x), _dtype(ctx, e)
    if xd == "f32" and ed != "f32":
        if e in ctx.g.consts:
            e = ctx.add_const(ctx.fresh(e + ".f32"), ctx.g.consts[e].astype(np.float32))
        else:
            e = _cast(ctx, e, "f32")
    elif xd != "f32" and ed == "f32":
        y = _bin(ctx, "pow", _cast(ctx, x, "f32"), e)
        _cast(ctx, y, xd, outs[0])
        return
    elif xd != ed:
        e = (
            _cast(ctx, e, xd)
            if e not in ctx.g.consts
            else ctx.add_const(ctx.fresh(e + "." + xd), ctx.g.consts[e].astype(TENSOR_DTYPES[xd]))
        )
    _bin(ctx, "pow", x, e, outs[0])


def eye_like(ctx, ins, outs, a):
    """EyeLike: ones on the ``k``-th diagonal of a 2-D tensor of x's shape: a constant
    (x's values are not read)."""
    xs = ctx.shape(ins[0])
    if len(xs) != 2:
        raise ctx.fail(f"input rank {len(xs)}; EyeLike takes a 2-D tensor")
    from onnx import helper

    dt = int(a["dtype"]) if "dtype" in a else None
    np_dt = helper.tensor_dtype_to_np_dtype(dt) if dt else TENSOR_DTYPES[_dtype(ctx, ins[0])]
    ctx.add_const(outs[0], np.eye(xs[0], xs[1], k=int(a.get("k", 0)), dtype=np_dt))


def _slice_last(ctx, x: str, start: int, step: int, size: int) -> str:
    xs = ctx.shape(x)
    r = len(xs)
    return ctx.emit("slice", [x], ctx.fresh(f"{x}.s{start}"),
                    {"starts": [0] * (r - 1) + [start], "steps": [1] * (r - 1) + [step],
                     "sizes": [*xs[:-1], size]})  # fmt: skip


def _reshape(ctx, x: str, shape, out: str | None = None) -> str:
    return ctx.emit("reshape", [x], out or ctx.fresh(x + ".r"), {"shape": [int(d) for d in shape]})


def rotary_embedding(ctx, ins, outs, a):
    """RotaryEmbedding (opset 23): the first ``rotary_embedding_dim`` features of each
    head rotated by the cos/sin caches (at position_ids, or given per token), as
    halves or interleaved pairs: real = cos x1 - sin x2, imag = sin x1 + cos x2."""
    x, cos, sin = ins[:3]
    pos = ins[3] if len(ins) > 3 and ins[3] else ""
    xs = ctx.shape(x)
    if len(xs) == 3:  # [B, S, hidden] -> [B, S, H, D]; the caches broadcast over H
        h = int(a.get("num_heads", 0))
        if h <= 0 or xs[2] % h:
            raise ctx.fail(f"3-D input {list(xs)} needs num_heads dividing {xs[2]}")
        x4 = _reshape(ctx, x, (xs[0], xs[1], h, xs[2] // h))
        head_axis = 2
    elif len(xs) == 4:  # [B, H, S, D]
        x4, head_axis = x, 1
    else:
        raise ctx.fail(f"input rank {len(xs)}; expected 3 or 4")
    b, d = xs[0], ctx.shape(x4)[3]
    seq = xs[1] if len(xs) == 3 else xs[2]
    rd = int(a.get("rotary_embedding_dim", 0)) or d
    half = rd // 2
    if rd % 2 or rd > d:
        raise ctx.fail(f"rotary_embedding_dim {rd} for heads of {d}")
    caches = []
    for t in (cos, sin):
        if pos:
            t = ctx.emit("take", [t, pos], ctx.fresh(t + ".at"), {"axis": 0})
        if tuple(ctx.shape(t)) != (b, seq, half):
            raise ctx.fail(f"a cache of {list(ctx.shape(t))} for [{b}, {seq}, {half}]")
        shape = [b, seq, half]
        shape.insert(head_axis, 1)
        caches.append(_reshape(ctx, t, shape))
    c, s_ = caches
    inter = bool(int(a.get("interleaved", 0)))
    x1 = _slice_last(ctx, x4, 0, 2 if inter else 1, half)
    x2 = _slice_last(ctx, x4, 1 if inter else half, 2 if inter else 1, half)
    real = _bin(ctx, "sub", _bin(ctx, "mul", c, x1), _bin(ctx, "mul", s_, x2))
    imag = _bin(ctx, "add", _bin(ctx, "mul", s_, x1), _bin(ctx, "mul", c, x2))
    lead = list(ctx.shape(x1)[:-1])
    if inter:  # pairs (real, imag) side by side
        parts = [_reshape(ctx, t, [*lead, half, 1]) for t in (real, imag)]
        pairs = ctx.emit("concat", parts, ctx.fresh(x + ".pairs"), {"axis": len(lead) + 1})
        rot = _reshape(ctx, pairs, [*lead, rd])
    else:
        rot = ctx.emit("concat", [real, imag], ctx.fresh(x + ".rot"), {"axis": len(lead)})
    y = rot
    if rd < d:
        rest = _slice_last(ctx, x4, rd, 1, d - rd)
        y = ctx.emit("concat", [rot, rest], ctx.fresh(x + ".all"), {"axis": len(lead)})
    _reshape(ctx, y, xs, outs[0])


def _nll(ctx, logp: str, target: str, weight: str, a: dict, out: str) -> None:
    """NegativeLogLikelihoodLoss of log-probabilities [N, C, d...] at target [N, d...]:
    -logp[n, target, d...] * weight[target], 0 where target is ignore_index; reduced
    by none, sum, or mean (over the weights of the targets counted)."""
    xs = ctx.shape(logp)
    ts = list(ctx.shape(target))
    if ts != [xs[0], *xs[2:]]:
        raise ctx.fail(f"target {ts} for input {list(xs)}")
    reduction = a.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    if reduction not in ("none", "sum", "mean"):
        raise ctx.fail(f"reduction={reduction!r}; supported: none, sum, mean")
    t, ignore = target, None
    if "ignore_index" in a:
        tdt = TENSOR_DTYPES[_dtype(ctx, t)]
        ii = ctx.add_const(
            ctx.fresh(ctx.node_name + ".ii"), np.asarray(int(a["ignore_index"]), tdt)
        )
        ignore = ctx.emit("compare", [t, ii], ctx.fresh(ctx.node_name + ".ignored"),
                          {"kind": "equal"})  # fmt: skip
        z = ctx.add_const(
            ctx.fresh(ctx.node_name + ".z"), np.zeros((), TENSOR_DTYPES[_dtype(ctx, t)])
        )
        t = ctx.emit("where", [ignore, z, t], ctx.fresh(ctx.node_name + ".target"), {})
    picked = ctx.emit("gather_elements", [logp, _reshape(ctx, t, [xs[0], 1, *xs[2:]])],
                      ctx.fresh(ctx.node_name + ".picked"), {"axis": 1})  # fmt: skip
    minus = ctx.add_const(ctx.fresh(ctx.node_name + ".minus"), np.float32(-1.0))
    loss = _bin(ctx, "mul", _reshape(ctx, picked, ts), minus)
    w = ""
    if weight:
        w = ctx.emit("take", [weight, t], ctx.fresh(ctx.node_name + ".w"), {"axis": 0})
        loss = _bin(ctx, "mul", loss, w)
    zero = ctx.add_const(ctx.fresh(ctx.node_name + ".zero"), np.zeros((), np.float32))
    if ignore is not None:
        loss = ctx.emit("where", [ignore, zero, loss], ctx.fresh(ctx.node_name + ".kept"), {})
    if reduction == "none":
        ctx.emit("reshape", [loss], out, {"shape": ts})
        return
    every = {"kind": "sum", "axes": list(range(len(ts))), "keepdims": 0}
    total = ctx.emit("reduce", [loss], out if reduction == "sum" else ctx.fresh(out + ".sum"),
                     every)  # fmt: skip
    if reduction == "sum":
        return
    counted = w or ctx.add_const(ctx.fresh(ctx.node_name + ".ones"), np.ones(ts, np.float32))
    if ignore is not None:
        counted = ctx.emit("where", [ignore, zero, counted], ctx.fresh(ctx.node_name + ".n"), {})
    if counted in ctx.g.consts and ignore is None:
        n = ctx.add_const(ctx.fresh(ctx.node_name + ".count"), np.float32(np.prod(ts)))
    else:
        n = ctx.emit("reduce", [counted], ctx.fresh(ctx.node_name + ".count"), every)
    _bin(ctx, "div", total, n, out)


def nll_loss(ctx, ins, outs, a):
    _nll(ctx, ins[0], ins[1], ins[2] if len(ins) > 2 else "", a, outs[0])


def softmax_cross_entropy(ctx, ins, outs, a):
    """SoftmaxCrossEntropyLoss: NLL of log_softmax(scores, axis 1); the optional
    second output is those log-probabilities."""
    xs = ctx.shape(ins[0])
    logp = outs[1] if len(outs) > 1 and outs[1] else ctx.fresh(outs[0] + ".logp")
    ctx.emit("softmax", [ins[0]], logp, {"axis": 1 % len(xs), "log": True})
    _nll(ctx, logp, ins[1], ins[2] if len(ins) > 2 else "", a, outs[0])


def affine_grid(ctx, ins, outs, a):
    """AffineGrid: each output point's normalized coordinates (x, y[, z], 1), constants
    of the plan, times theta [N, 2 or 3, 3 or 4] (a broadcast multiply and a sum over
    the last axis: grid[n, p, j] = sum_k base[p, k] theta[n, j, k])."""
    theta = ins[0]
    size = [int(v) for v in np.asarray(ctx.const(ins[1], "size")).reshape(-1)]
    n, spatial = size[0], size[2:]
    nd = len(spatial)
    if nd not in (2, 3) or tuple(ctx.shape(theta)) != (n, nd, nd + 1):
        raise ctx.fail(f"theta {list(ctx.shape(theta))} for size {size}")
    align = bool(int(a.get("align_corners", 0)))

    def axis(d: int) -> np.ndarray:
        if align:
            return np.linspace(-1.0, 1.0, d) if d > 1 else np.zeros(1)
        return (2 * np.arange(d) + 1) / d - 1

    mesh = np.meshgrid(*[axis(d) for d in spatial], indexing="ij")  # D, H, W order
    coords = [m.reshape(-1) for m in mesh][::-1]  # x (innermost) first
    pts = int(np.prod(spatial))
    base = np.stack([*coords, np.ones(pts)], axis=1).astype(np.float32)  # [P, nd + 1]
    bn = ctx.add_const(ctx.fresh(ctx.node_name + ".base"), base.reshape(1, pts, 1, nd + 1))
    t4 = _reshape(ctx, theta, (n, 1, nd, nd + 1))
    prod = _bin(ctx, "mul", t4, bn)
    g = ctx.emit("reduce", [prod], ctx.fresh(ctx.node_name + ".g"),
                 {"kind": "sum", "axes": [3], "keepdims": 0})  # fmt: skip
    _reshape(ctx, g, (n, *spatial, nd), outs[0])


def col2im(ctx, ins, outs, a):
    """Col2Im: the blocks' values summed into the image they were cut from: one
    scatter_elements (add) of the flattened input into a zero image with one spare
    slot at the end, which takes what falls in the padding, at constant indices."""
    x = ins[0]
    n, ck, blocks = ctx.shape(x)
    img = [int(v) for v in np.asarray(ctx.const(ins[1], "image_shape")).reshape(-1)]
    blk = [int(v) for v in np.asarray(ctx.const(ins[2], "block_shape")).reshape(-1)]
    nd = len(img)
    d = list(a.get("dilations", [1] * nd))
    s = list(a.get("strides", [1] * nd))
    p = list(a.get("pads", [0] * (2 * nd)))
    k = int(np.prod(blk))
    counts = [
        (img[i] + p[i] + p[nd + i] - (d[i] * (blk[i] - 1) + 1)) // s[i] + 1 for i in range(nd)
    ]
    if ck % k or int(np.prod(counts)) != blocks or len(blk) != nd:
        raise ctx.fail(f"input {[n, ck, blocks]} for image {img}, blocks {blk}")
    c, hw = ck // k, int(np.prod(img))
    kk = np.indices(blk).reshape(nd, -1)  # [nd, K]
    bb = np.indices(counts).reshape(nd, -1)  # [nd, L]
    pos = (
        bb[:, None, :] * np.asarray(s)[:, None, None]
        + kk[:, :, None] * np.asarray(d)[:, None, None]
    )
    pos = pos - np.asarray(p[:nd])[:, None, None]  # [nd, K, L] image coordinates
    inside = np.all((pos >= 0) & (pos < np.asarray(img)[:, None, None]), axis=0)
    flat = np.ravel_multi_index(tuple(np.clip(pos, 0, np.asarray(img)[:, None, None] - 1)), img)
    flat = np.where(inside, flat, -1)  # -1: the spare slot
    idx = (np.arange(c)[:, None, None] * hw + flat[None]).reshape(1, -1)
    idx = np.where(idx < 0, c * hw, idx)
    idx = np.broadcast_to(idx, (n, idx.shape[1])).astype(np.int64)
    zeros = ctx.add_const(
        ctx.fresh(ctx.node_name + ".canvas"), np.zeros((n, c * hw + 1), np.float32)
    )
    at = ctx.add_const(ctx.fresh(ctx.node_name + ".at"), idx.copy())
    flat_x = _reshape(ctx, x, (n, ck * blocks))
    summed = ctx.emit("scatter_elements", [zeros, at, flat_x], ctx.fresh(ctx.node_name + ".sum"),
                      {"axis": 1, "reduction": "add"})  # fmt: skip
    cut = ctx.emit("slice", [summed], ctx.fresh(ctx.node_name + ".img"),
                   {"starts": [0, 0], "steps": [1, 1], "sizes": [n, c * hw]})  # fmt: skip
    _reshape(ctx, cut, (n, c, *img), outs[0])


def tensor_scatter(ctx, ins, outs, a):
    """TensorScatter (opset 24, a KV cache update): update written into past_cache
    along ``axis`` from write_indices[b] on (mode circular: modulo the cache's length);
    a scatter_elements at indices write_indices[b] + j made each run."""
    past, upd = ins[:2]
    wi = ins[2] if len(ins) > 2 and ins[2] else ""
    ps, us = ctx.shape(past), ctx.shape(upd)
    r = len(ps)
    ax = int(a.get("axis", -2)) % r
    if ax == 0 or any(ps[i] != us[i] for i in range(r) if i != ax) or us[ax] > ps[ax]:
        raise ctx.fail(f"update {list(us)} into cache {list(ps)} along axis {ax}")
    mode = a.get("mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    along = [1] * r
    along[ax] = us[ax]
    steps = ctx.add_const(ctx.fresh(ctx.node_name + ".steps"),
                          np.arange(us[ax], dtype=np.int64).reshape(along))  # fmt: skip
    if wi:
        w = _reshape(ctx, wi, [ps[0]] + [1] * (r - 1))
        if _dtype(ctx, w) != "i64":
            w = _cast(ctx, w, "i64")
        steps = _bin(ctx, "add", w, steps)
    if mode == "circular":
        length = ctx.add_const(ctx.fresh(ctx.node_name + ".len"), np.asarray(ps[ax], np.int64))
        steps = _bin(ctx, "mod", steps, length)
    elif mode != "linear":
        raise ctx.fail(f"mode={mode!r}; supported: linear, circular")
    at = ctx.emit("expand", [steps], ctx.fresh(ctx.node_name + ".at"), {"shape": list(us)})
    ctx.emit("scatter_elements", [past, at, upd], outs[0], {"axis": ax, "reduction": "none"})


COMPOSITE_HANDLERS = {
    "Col2Im": col2im,
    "TensorScatter": tensor_scatter,
    "RotaryEmbedding": rotary_embedding,
    "NegativeLogLikelihoodLoss": nll_loss,
    "SoftmaxCrossEntropyLoss": softmax_cross_entropy,
    "AffineGrid": affine_grid,
    "PRelu": prelu,
    "Swish": swish,
    "Tile": tile,
    "CenterCropPad": center_crop_pad,
    "BitwiseAnd": bitwise("bit_and"),
    "BitwiseOr": bitwise("bit_or"),
    "BitwiseXor": bitwise("bit_xor"),
    "BitwiseNot": bitwise_not,
    "Pow": pow_,
    "EyeLike": eye_like,
}
