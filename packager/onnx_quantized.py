"""Pre-quantized ONNX models: QuantizeLinear / DequantizeLinear (the QDQ models ONNX
Runtime's ``quantize_static`` writes), DynamicQuantizeLinear, QLinearMatMul,
QLinearConv, MatMulInteger and ConvInteger.

Constant operands fold at pack time: a weight's DequantizeLinear becomes its float32
weights, which ``--quant`` then stores as edgepack's own types. At run time each op is
lowered onto edgepack's float ops as ONNX's operator text defines it:

    QuantizeLinear    y = cast(clip(round(x / scale) + zero_point, qmin, qmax))
    DequantizeLinear  y = (float(x) - zero_point) * scale
    QLinear*          DequantizeLinear of the inputs, the float op, QuantizeLinear
    *Integer          the float op of (float(x) - zero_point), cast to int32

``round`` is half to even, as ONNX's. The integer products of MatMulInteger and
ConvInteger are summed in float32: exact while a sum stays below 2**24 (K up to 1024
at full-range uint8 x int8 values, far more at typical ones).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

# the saturation range of each quantized type (ONNX's QuantizeLinear)
QRANGE = {"u8": (0, 255), "i8": (-128, 127), "u16": (0, 65535), "i16": (-32768, 32767)}
_NO_ACT = {"act": "none", "act_args": [0.0, 0.0]}


def _code_of(ctx, code: str | None) -> str:
    if code not in QRANGE and code != "i32":
        raise ctx.fail(f"quantized type {code}; supported: uint8, int8, uint16, int16")
    return code


def _param(ctx, name: str, rank: int, axis: int, what: str) -> str:
    """A scale or zero point (a constant or a run-time tensor; one value, or one per
    ``axis``) as a float32 tensor that broadcasts against a rank-``rank`` one."""
    shape = list(ctx.shape(name))
    size = int(np.prod(shape))
    if size != 1 and len(shape) != 1:
        raise ctx.fail(f"{what} of shape {shape}: blocked quantization is not supported")
    target = [1] * rank
    if size != 1:
        target[axis] = size
    if name in ctx.g.consts:
        v = np.asarray(ctx.g.consts[name]).astype(np.float32)
        return _const(ctx, what.replace(" ", "_"), v.reshape(target if size != 1 else ()))
    t = name
    if ctx.g.dtype(name) != "f32":
        t = ctx.emit("cast", [t], ctx.fresh(name + ".f32"), {"to": "f32"})
    if size != 1:
        t = ctx.emit("reshape", [t], ctx.fresh(name + ".b"), {"shape": target})
    return t


def _is_zero(ctx, name: str) -> bool:
    return name in ctx.g.consts and not np.any(ctx.g.consts[name])


def _params(ctx, ins: list[str], a: dict, rank: int, out_code: str | None = None):
    """(scale, zero point or None where it is zero: float32 tensor names, the quantized
    type code) of a Quantize- or DequantizeLinear-shaped input triple (x, scale, zp)."""
    from ..runtime.bundle_format import TENSOR_CODES

    if int(a.get("block_size", 0)):
        raise ctx.fail("blocked quantization (block_size) is not supported")
    axis = int(a.get("axis", 1))
    axis = axis + rank if axis < 0 else axis
    scale = _param(ctx, ins[1], rank, axis, "scale")
    zp = ins[2] if len(ins) > 2 and ins[2] else ""
    if zp:
        code = TENSOR_CODES.get(ctx.g.consts[zp].dtype) if zp in ctx.g.consts else ctx.g.dtype(zp)
    else:
        code = out_code or "u8"
    zp_f = None if not zp or _is_zero(ctx, zp) else _param(ctx, zp, rank, axis, "zero point")
    return scale, zp_f, _code_of(ctx, code)


def _const(ctx, base: str, value: np.ndarray) -> str:
    return ctx.add_const(ctx.fresh(f"{ctx.node_name}.{base}"), np.asarray(value))


def quantize(ctx, x: str, scale: str, zp: str | None, code: str, out: str) -> str:
    """out = cast(clip(round(x / scale) + zp, qmin, qmax)) of a float32 tensor ``x``."""
    lo, hi = QRANGE[code]
    t = ctx.emit("binary", [x, scale], ctx.fresh(out + ".div"), {"kind": "div", **_NO_ACT})
    t = ctx.emit("math", [t], ctx.fresh(out + ".round"), {"fn": "round", "args": [0.0, 0.0]})
    clip = {"act": "clip", "act_args": [float(lo), float(hi)]}
    if zp is not None:
        t = ctx.emit("binary", [t, zp], ctx.fresh(out + ".zp"), {"kind": "add", **clip})
    else:
        t = ctx.emit("unary", [t], ctx.fresh(out + ".clip"), clip)
    return ctx.emit("cast", [t], out, {"to": code})


def dequantize(ctx, x: str, scale: str, zp: str | None, out: str) -> str:
    """out = (float(x) - zp) * scale of an integer tensor ``x`` (folded when every
    input is a constant: a weight)."""
    t = ctx.emit("cast", [x], ctx.fresh(out + ".f32"), {"to": "f32"})
    if zp is not None:
        t = ctx.emit("binary", [t, zp], ctx.fresh(out + ".zp"), {"kind": "sub", **_NO_ACT})
    return ctx.emit("binary", [t, scale], out, {"kind": "mul", **_NO_ACT})


def _quantize_linear(ctx, ins, outs, a):
    from ..runtime.bundle_format import TENSOR_CODES

    rank = len(ctx.shape(ins[0]))
    to = int(a.get("output_dtype", 0))
    code = TENSOR_CODES.get(np.dtype(helper.tensor_dtype_to_np_dtype(to))) if to else None
    scale, zp, code = _params(ctx, ins, a, rank, code)
    if code == "i32":
        raise ctx.fail("QuantizeLinear to int32 is not supported")
    quantize(ctx, ins[0], scale, zp, code, outs[0])


def _dequantize_linear(ctx, ins, outs, a):
    scale, zp, _ = _params(ctx, ins, a, len(ctx.shape(ins[0])))
    dequantize(ctx, ins[0], scale, zp, outs[0])


def _dynamic_quantize_linear(ctx, ins, outs, a):
    """DynamicQuantizeLinear: uint8 over [min(0, min x), max(0, max x)], the scale and
    zero point computed each run."""
    x = ins[0]
    axes = list(range(len(ctx.shape(x))))
    f = ctx.fresh
    zero = _const(ctx, "zero", np.float32(0.0))
    mx = ctx.emit("reduce", [x], f(x + ".max"), {"kind": "max", "axes": axes, "keepdims": 0})
    mn = ctx.emit("reduce", [x], f(x + ".min"), {"kind": "min", "axes": axes, "keepdims": 0})
    mx = ctx.emit("binary", [mx, zero], f(x + ".max0"), {"kind": "max", **_NO_ACT})
    mn = ctx.emit("binary", [mn, zero], f(x + ".min0"), {"kind": "min", **_NO_ACT})
    span = ctx.emit("binary", [mx, mn], f(x + ".span"), {"kind": "sub", **_NO_ACT})
    scale = ctx.emit("binary", [span, _const(ctx, "255", np.float32(255.0))],
                     outs[1] if len(outs) > 1 and outs[1] else f(x + ".scale"),
                     {"kind": "div", **_NO_ACT})  # fmt: skip
    # zero point: saturate(round(-min / scale)), as a float, then its uint8
    zq = ctx.emit("binary", [zero, mn], f(x + ".negmin"), {"kind": "sub", **_NO_ACT})
    zq = ctx.emit("binary", [zq, scale], f(x + ".zq"), {"kind": "div", **_NO_ACT})
    zq = ctx.emit("math", [zq], f(x + ".zround"), {"fn": "round", "args": [0.0, 0.0]})
    zq = ctx.emit("unary", [zq], f(x + ".zclip"), {"act": "clip", "act_args": [0.0, 255.0]})
    if len(outs) > 2 and outs[2]:
        ctx.emit("cast", [zq], outs[2], {"to": "u8"})
    t = ctx.emit("binary", [x, scale], f(x + ".div"), {"kind": "div", **_NO_ACT})
    t = ctx.emit("math", [t], f(x + ".round"), {"fn": "round", "args": [0.0, 0.0]})
    t = ctx.emit("binary", [t, zq], f(x + ".q"), {"kind": "add", "act": "clip",
                                                  "act_args": [0.0, 255.0]})  # fmt: skip
    ctx.emit("cast", [t], outs[0], {"to": "u8"})


def _qlinear(float_op, handlers: dict):
    """QLinearMatMul (a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) and QLinearConv
    (x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias int32)."""

    def handler(ctx, ins, outs, a):
        ins = ins + [""] * (9 - len(ins))
        ra, rb = len(ctx.shape(ins[0])), len(ctx.shape(ins[3]))
        sa, za, _ = _params(ctx, ins[0:3], {"axis": 1}, ra)
        # per output channel: a conv weight's axis 0, a matmul right-hand side's last
        sb, zb, _ = _params(ctx, ins[3:6], {"axis": 0 if float_op == "Conv" else rb - 1}, rb)
        args = [dequantize(ctx, ins[0], sa, za, ctx.fresh(ins[0] + ".dq")),
                dequantize(ctx, ins[3], sb, zb, ctx.fresh(ins[3] + ".dq"))]  # fmt: skip
        if float_op == "Conv" and ins[8]:  # int32 bias at x_scale * w_scale
            bs = ctx.emit(
                "binary", [sa, sb], ctx.fresh(ins[8] + ".scale"), {"kind": "mul", **_NO_ACT}
            )
            if bs not in ctx.g.consts:
                raise ctx.fail("a bias with scales given at run time is not supported")
            bias = ctx.const(ins[8], "bias").astype(np.float32) * ctx.g.consts[bs].reshape(-1)
            args.append(_const(ctx, "bias", bias.astype(np.float32)))
        y = ctx.fresh(outs[0] + ".float")
        handlers[float_op](ctx, args, [y], dict(a))
        sy, zy, code = _params(ctx, ["", ins[6], ins[7]], {"axis": 1}, len(ctx.shape(y)))
        quantize(ctx, y, sy, zy, code, outs[0])

    return handler


def _integer(float_op, handlers: dict):
    """MatMulInteger (a, b, a_zp, b_zp) and ConvInteger (x, w, x_zp, w_zp): int32 out."""

    def handler(ctx, ins, outs, a):
        ins = ins + [""] * (4 - len(ins))
        ra, rb = len(ctx.shape(ins[0])), len(ctx.shape(ins[1]))
        # A's zero point: one, or a row's (MatMul); B's: one, or an output channel's
        axis_a, axis_b = (1, 0) if float_op == "Conv" else (max(ra - 2, 0), rb - 1)
        fs = []
        for x, zp, rank, axis in ((ins[0], ins[2], ra, axis_a), (ins[1], ins[3], rb, axis_b)):
            t = ctx.emit("cast", [x], ctx.fresh(x + ".f32"), {"to": "f32"})
            if zp and not _is_zero(ctx, zp):
                zf = _param(ctx, zp, rank, axis, "zero point")
                t = ctx.emit("binary", [t, zf], ctx.fresh(x + ".zp"), {"kind": "sub", **_NO_ACT})
            fs.append(t)
        y = ctx.fresh(outs[0] + ".float")
        handlers[float_op](ctx, fs, [y], dict(a))
        ctx.emit("cast", [y], outs[0], {"to": "i32"})

    return handler


def quantized_handlers(handlers: dict) -> dict:
    """The quantized ops' import handlers; ``handlers`` is the importer's table, whose
    MatMul and Conv run the float op between (looked up when a node is imported)."""
    return {
        "QuantizeLinear": _quantize_linear,
        "DequantizeLinear": _dequantize_linear,
        "DynamicQuantizeLinear": _dynamic_quantize_linear,
        "QLinearMatMul": _qlinear("MatMul", handlers),
        "QLinearConv": _qlinear("Conv", handlers),
        "MatMulInteger": _integer("MatMul", handlers),
        "ConvInteger": _integer("Conv", handlers),
    }
