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


COMPOSITE_HANDLERS = {
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
