"""ONNX's normalizations -> edgepack IR: BatchNormalization, LayerNormalization,
RMSNormalization, InstanceNormalization, GroupNormalization, LRN and
MeanVarianceNormalization.

The fast path is the ``norm`` op over rows (and ``channel_affine`` for per-channel
weights) with constant weights. Weights given at run time (a graph input, or a
tensor computed from one) are applied after a weightless norm as broadcasting
multiplies and adds. LayerNormalization's optional Mean and InvStdDev outputs are
computed beside the norm from reductions, as its function body defines them.

The handlers take the importer's context (packager/onnx_import.py ``_Ctx``); this
module needs nothing else from the importer.
"""

from __future__ import annotations

import numpy as np

_NO_ACT = {"act": "none", "act_args": [0.0, 0.0]}


def _reshape(ctx, x: str, shape, out: str | None = None) -> str:
    return ctx.emit("reshape", [x], out or ctx.fresh(x + ".r"), {"shape": [int(d) for d in shape]})


def _bin(ctx, kind: str, a: str, b: str, out: str | None = None) -> str:
    return ctx.emit("binary", [a, b], out or ctx.fresh(f"{ctx.node_name}.{kind}"),
                    {"kind": kind, **_NO_ACT})  # fmt: skip


def _sqrt(ctx, x: str) -> str:
    return ctx.emit("math", [x], ctx.fresh(x + ".sqrt"), {"fn": "sqrt", "args": [0.0, 0.0]})


def _scalar(ctx, what: str, v: float) -> str:
    return ctx.add_const(ctx.fresh(f"{ctx.node_name}.{what}"), np.float32(v))


def _runtime_weight(ctx, name: str, inner: tuple[int, ...], shape, what: str) -> str:
    """A run-time weight broadcast to ``inner`` (the normalized axes), reshaped to
    ``shape`` so that it broadcasts against the normalized rows."""
    ws = ctx.shape(name)
    try:
        np.broadcast_shapes(ws, inner)
    except ValueError:
        raise ctx.fail(f"{what} of shape {list(ws)} for axes {list(inner)}") from None
    if tuple(ws[-len(inner) :] if len(ws) >= len(inner) else ()) != tuple(inner):
        name = ctx.emit("expand", [name], ctx.fresh(name + ".x"), {"shape": list(inner)})
    if ctx.g.dtype(name) != "f32":
        name = ctx.emit("cast", [name], ctx.fresh(name + ".f32"), {"to": "f32"})
    return _reshape(ctx, name, shape)


def _batchnorm_training(ctx, ins, outs, a):
    """training_mode=1: normalized by the batch's own mean and (biased) variance over
    N and the spatial axes; the running statistics outputs are momentum * given +
    (1 - momentum) * the batch's, as ONNX's reference."""
    x = ins[0]
    xs = ctx.shape(x)
    c, mom = xs[1], float(a.get("momentum", 0.9))
    per_c = [1, c] + [1] * (len(xs) - 2)
    red = {"kind": "mean", "axes": [0, *range(2, len(xs))], "keepdims": 1}
    mean = ctx.emit("reduce", [x], ctx.fresh(ctx.node_name + ".bmean"), red)
    d = _bin(ctx, "sub", x, mean)
    var = ctx.emit("reduce", [_bin(ctx, "mul", d, d)], ctx.fresh(ctx.node_name + ".bvar"), red)
    std = _sqrt(ctx, _bin(ctx, "add", var, _scalar(ctx, "eps", a.get("epsilon", 1e-5))))
    gamma, beta = (_reshape(ctx, n, per_c) for n in ins[1:3])
    _bin(ctx, "add", _bin(ctx, "mul", _bin(ctx, "div", d, std), gamma), beta, outs[0])
    for out, batch, given in zip(outs[1:3], (mean, var), ins[3:5]):
        if out:
            old = _bin(ctx, "mul", given, _scalar(ctx, "momentum", mom))
            new = _bin(ctx, "mul", _reshape(ctx, batch, (c,)), _scalar(ctx, "rest", 1.0 - mom))
            _bin(ctx, "add", old, new, out)


def batchnorm(ctx, ins, outs, a):
    if int(a.get("training_mode", 0)):
        return _batchnorm_training(ctx, ins, outs, a)
    if len(outs) > 1 and any(outs[1:]):
        raise ctx.fail("running-statistics outputs need training_mode=1")
    x = ins[0]
    if all(n in ctx.g.consts for n in ins[1:5]):
        gamma, beta, mean, var = (ctx.const(n).astype(np.float64) for n in ins[1:5])
        eps = float(a.get("epsilon", 1e-5))
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        sn = ctx.add_const(ctx.fresh(ctx.node_name + ".scale"), scale.astype(np.float32))
        tn = ctx.add_const(ctx.fresh(ctx.node_name + ".shift"), shift.astype(np.float32))
        ctx.emit("channel_affine", [x, sn, tn], outs[0], dict(_NO_ACT))
        return
    # statistics or weights at run time: (x - mean) / sqrt(var + eps) * gamma + beta,
    # each per channel (axis 1) broadcast over the rest
    xs = ctx.shape(x)
    per_c = [1, xs[1]] + [1] * (len(xs) - 2)
    gamma, beta, mean, var = (_reshape(ctx, n, per_c) for n in ins[1:5])
    std = _sqrt(ctx, _bin(ctx, "add", var, _scalar(ctx, "eps", a.get("epsilon", 1e-5))))
    k = _bin(ctx, "div", gamma, std)
    _bin(ctx, "add", _bin(ctx, "mul", _bin(ctx, "sub", x, mean), k), beta, outs[0])


def _stats(ctx, x: str, ax: int, eps: float, mean_out: str, inv_out: str) -> None:
    """LayerNormalization's Mean and InvStdDev outputs (float32, the normalized axes
    kept as 1s): mean, and 1 / sqrt(mean((x - mean)^2) + eps)."""
    axes = list(range(ax, len(ctx.shape(x))))
    red = {"kind": "mean", "axes": axes, "keepdims": 1}
    mean = ctx.emit("reduce", [x], mean_out or ctx.fresh(x + ".mean"), red)
    if not inv_out:
        return
    d = _bin(ctx, "sub", x, mean)
    var = ctx.emit("reduce", [_bin(ctx, "mul", d, d)], ctx.fresh(x + ".var"), red)
    std = _sqrt(ctx, _bin(ctx, "add", var, _scalar(ctx, "eps", eps)))
    ctx.emit("math", [std], inv_out, {"fn": "reciprocal", "args": [0.0, 0.0]})


def layer_norm(kind: str):
    """LayerNormalization / RMSNormalization over the axes from ``axis`` on: the rows of
    x as [outer, inner] through the norm op, its weights (and bias) broadcast to
    inner; weights given at run time multiply and add after a weightless norm."""

    def handler(ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        ax = int(a.get("axis", -1))
        if not -len(xs) <= ax < len(xs):
            raise ctx.fail(f"axis {ax} out of range for rank {len(xs)}")
        ax %= len(xs)
        if int(a.get("stash_type", 1)) != 1:
            raise ctx.fail("stash_type other than float32 is not supported")
        inner = xs[ax:]
        outer, n = int(np.prod(xs[:ax])), int(np.prod(inner))
        eps = float(a.get("epsilon", 1e-5))
        if any(outs[1:]):
            _stats(ctx, ins[0], ax, eps, *(list(outs[1:]) + [""])[:2])
        w = b = ""  # constant weights, fused into the norm node
        late = []  # run-time ones, applied to its output: (binary kind, tensor)
        for i, what in ((1, "scale"), (2, "bias")):
            t = ins[i] if len(ins) > i else ""
            if not t:
                continue
            if t not in ctx.g.consts:
                rt = _runtime_weight(ctx, t, inner, (1, n), what)
                late.append(("mul" if i == 1 else "add", rt))
                continue
            v = ctx.const(t, what).astype(np.float32)
            try:
                v = np.broadcast_to(v, inner).reshape(n)
            except ValueError:
                raise ctx.fail(f"{what} of shape {list(v.shape)} for axes {list(inner)}") from None
            c = ctx.add_const(ctx.fresh(f"{ctx.node_name}.{what}"), v.copy())
            if late:  # a constant bias after a run-time scale
                late.append(("add", c))
            elif i == 1:
                w = c
            else:
                b = c
        if not w and late:  # the norm node takes a weight: ones, the run-time one after
            w = ctx.add_const(ctx.fresh(ctx.node_name + ".ones"), np.ones(n, np.float32))
        rows = _reshape(ctx, ins[0], (outer, n), ctx.fresh(ins[0] + ".rows"))
        y = ctx.emit("norm", [rows, w] + ([b] if b else []), ctx.fresh(outs[0] + ".rows"),
                     {"kind": kind, "eps": eps})  # fmt: skip
        for k, t in late:
            y = _bin(ctx, k, y, t)
        _reshape(ctx, y, xs, outs[0])

    return handler


def group_norm(instance: bool):
    """InstanceNormalization (a group per channel) and GroupNormalization: the rows of
    each (image, group) through the norm op (mean and variance, no weights), then the
    per-channel scale and bias as channel_affine (BatchNormalization's op), or as a
    multiply and an add where they arrive at run time."""

    def handler(ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        if len(xs) < 3:
            raise ctx.fail(f"input rank {len(xs)}; expected N, C and spatial axes")
        n, c, spatial = xs[0], xs[1], int(np.prod(xs[2:]))
        groups = c if instance else int(a["num_groups"])
        if groups < 1 or c % groups:
            raise ctx.fail(f"{c} channels in {groups} groups")
        per_group = not instance and ctx.opset < 21  # opset 18: weights per group
        width = c // groups * spatial
        rows = _reshape(ctx, ins[0], (n * groups, width), ctx.fresh(ins[0] + ".groups"))
        ones = ctx.add_const(ctx.fresh(ctx.node_name + ".ones"), np.ones(width, np.float32))
        normed = ctx.emit("norm", [rows, ones], ctx.fresh(outs[0] + ".normed"),
                          {"kind": "layer", "eps": float(a.get("epsilon", 1e-5))})  # fmt: skip
        planes = _reshape(ctx, normed, (n, c, spatial, 1), ctx.fresh(outs[0] + ".planes"))
        if ins[1] in ctx.g.consts and ins[2] in ctx.g.consts:
            scale = ctx.const(ins[1], "scale").astype(np.float32).reshape(-1)
            bias = ctx.const(ins[2], "bias").astype(np.float32).reshape(-1)
            if per_group and scale.size == groups:
                scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
            if scale.size != c or bias.size != c:
                raise ctx.fail(f"scale/bias of {scale.size}/{bias.size} for {c} channels")
            sn = ctx.add_const(ctx.fresh(ctx.node_name + ".scale"), scale)
            bn = ctx.add_const(ctx.fresh(ctx.node_name + ".bias"), bias)
            y = ctx.emit("channel_affine", [planes, sn, bn], ctx.fresh(outs[0] + ".affine"),
                         dict(_NO_ACT))  # fmt: skip
            _reshape(ctx, y, xs, outs[0])
            return
        y = planes
        for i, kind in ((1, "mul"), (2, "add")):
            t = ins[i]
            size = int(np.prod(ctx.shape(t)))
            if size not in (c, groups) or (size != c and not per_group):
                raise ctx.fail(f"{'scale' if i == 1 else 'bias'} of {size} for {c} channels")
            if size != c:  # one per group: each repeated over its channels
                t = ctx.emit("expand", [_reshape(ctx, t, (groups, 1))], ctx.fresh(t + ".x"),
                             {"shape": [groups, c // groups]})  # fmt: skip
            if ctx.g.dtype(t) != "f32":
                t = ctx.emit("cast", [t], ctx.fresh(t + ".f32"), {"to": "f32"})
            y = _bin(ctx, kind, y, _reshape(ctx, t, (1, c, 1, 1)))
        _reshape(ctx, y, xs, outs[0])

    return handler


def lrn(ctx, ins, outs, a):
    """LRN: x / (bias + alpha / size * sum of x^2 over a window of channels)^beta. The
    window sum is a 1x1 convolution with a banded 0/1 matrix (channels below:
    floor((size - 1) / 2), above: ceil((size - 1) / 2), as ONNX defines it)."""
    xs = ctx.shape(ins[0])
    if len(xs) != 4:
        raise ctx.fail(f"input rank {len(xs)}; LRN is supported on NCHW tensors")
    size, c = int(a["size"]), xs[1]
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    idx = np.arange(c)
    band = (idx[None, :] >= idx[:, None] - lo) & (idx[None, :] <= idx[:, None] + hi)
    w = ctx.add_const(ctx.fresh(ctx.node_name + ".band"),
                      band.astype(np.float32).reshape(c, c, 1, 1))  # fmt: skip
    sq = _bin(ctx, "mul", ins[0], ins[0])
    s = ctx.emit("conv", [sq, w, ""], ctx.fresh(ctx.node_name + ".sum"),
                 {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1,
                  **_NO_ACT})  # fmt: skip
    t = _bin(ctx, "mul", s, _scalar(ctx, "alpha", float(a.get("alpha", 1e-4)) / size))
    t = _bin(ctx, "add", t, _scalar(ctx, "bias", a.get("bias", 1.0)))
    p = _bin(ctx, "pow", t, _scalar(ctx, "beta", a.get("beta", 0.75)))
    _bin(ctx, "div", ins[0], p, outs[0])


def mean_variance(ctx, ins, outs, a):
    """MeanVarianceNormalization: (x - mean) / sqrt(var + 1e-9) over ``axes`` (default
    0, 2, 3), the variance E[x^2] - E[x]^2 as ONNX's function body has it."""
    xs = ctx.shape(ins[0])
    axes = [int(v) % len(xs) for v in a.get("axes", [0, 2, 3])]
    red = {"kind": "mean", "axes": axes, "keepdims": 1}
    mean = ctx.emit("reduce", [ins[0]], ctx.fresh(ctx.node_name + ".mean"), red)
    ex2 = ctx.emit("reduce", [_bin(ctx, "mul", ins[0], ins[0])], ctx.fresh(ctx.node_name + ".ex2"),
                   red)  # fmt: skip
    var = _bin(ctx, "sub", ex2, _bin(ctx, "mul", mean, mean))
    std = _sqrt(ctx, _bin(ctx, "add", var, _scalar(ctx, "eps", 1e-9)))
    _bin(ctx, "div", _bin(ctx, "sub", ins[0], mean), std, outs[0])


NORM_HANDLERS = {
    "BatchNormalization": batchnorm,
    "LayerNormalization": layer_norm("layer"),
    "RMSNormalization": layer_norm("rms"),
    "InstanceNormalization": group_norm(True),
    "GroupNormalization": group_norm(False),
    "LRN": lrn,
    "MeanVarianceNormalization": mean_variance,
}
