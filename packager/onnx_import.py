"""ONNX (opsets 13-24; older ones converted to 13 first) -> edgepack IR, static shapes, folding.

One pass in ONNX's topological order. Each ONNX node is either folded to a constant
(all its inputs known at pack time, e.g. shape arithmetic) or lowered to IR ops
whose output shapes are computed here. Anything we cannot run fails the build with
the op, the node and what is supported.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..kernels.ops import GENERIC_OPS, INT_CONSTS, OUT_DTYPES, OpError, out_dtype, output_shape
from ..kernels.ops import get as get_op
from ..kernels.ref.reference import REFERENCE
from ..runtime.bundle_format import TENSOR_CODES, TENSOR_DTYPES
from .ir import Graph, Node, PackError
from .onnx_composite import COMPOSITE_HANDLERS
from .onnx_norms import NORM_HANDLERS
from .onnx_quantized import quantized_handlers

MIN_OPSET, MAX_OPSET = 13, 24


class _Ctx:
    def __init__(self, graph: Graph, opset: int) -> None:
        self.g = graph
        self.opset = opset
        self.node: onnx.NodeProto | None = None
        self.node_name = ""
        self.used: set[str] = set()
        self._uid = 0

    # -- helpers used by the op handlers --------------------------------------------
    def fail(self, msg: str) -> PackError:
        op = self.node.op_type if self.node is not None else "?"
        return PackError(f"op {op} at node {self.node_name!r}: {msg}")

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.g.consts:
            return tuple(self.g.consts[name].shape)
        return self.g.shapes[name]

    def const(self, name: str, what: str = "input") -> np.ndarray:
        if name not in self.g.consts:
            raise self.fail(f"{what} {name!r} must be a constant known at pack time")
        return self.g.consts[name]

    def opt_const(self, inputs: list[str], i: int) -> np.ndarray | None:
        if len(inputs) > i and inputs[i]:
            return self.const(inputs[i])
        return None

    def fresh(self, base: str) -> str:
        self._uid += 1
        return f"{base}::{self._uid}"

    def add_const(self, name: str, value: np.ndarray) -> str:
        value = np.asarray(value)
        self.g.consts[name] = value if value.flags.c_contiguous else value.copy(order="C")
        return name

    def emit(self, op: str, inputs: list[str], out: str, attrs: dict) -> str:
        """Add an IR node, or fold it when every input is a constant. Its output shape
        is the op table's (kernels/ops.py) shape function's."""
        in_shapes = [
            None if not i else (self.g.consts[i].shape if i in self.g.consts else self.shape(i))
            for i in inputs
        ]
        try:
            shape = output_shape(op, in_shapes, attrs)
        except OpError as e:
            raise self.fail(str(e)) from None
        consts = self.g.consts
        runtime = [self.g.dtype(i) for i in inputs if i and i not in consts]
        if op not in GENERIC_OPS and "f16" in runtime and set(runtime) <= {"f16", "f32"}:
            # float16 tensors through a float32 op: cast in, and out again where the op
            # gives floats (float16 values are exact in float32)
            ins32 = [i if not i or i in consts or self.g.dtype(i) != "f16" else
                     self.emit("cast", [i], self.fresh(i + ".f32"), {"to": "f32"})
                     for i in inputs]  # fmt: skip
            if OUT_DTYPES.get(op, "f32") != "f32":
                return self.emit(op, ins32, out, attrs)
            y32 = self.emit(op, ins32, self.fresh(out + ".f32"), attrs)
            return self.emit("cast", [y32], out, {"to": "f16"})
        # dtype-generic ops (and binary over integer tensors) keep every dtype; the
        # others take float32 tensors, their constants cast to float32 here
        generic = op in GENERIC_OPS or (op == "binary" and (
            any(d != "f32" for d in runtime) or
            (not runtime and any(consts[i].dtype.kind in "iub" for i in inputs if i))))  # fmt: skip
        ints = {get_op(op).roles.index(r) for r in INT_CONSTS.get(op, ())}

        def dtype_of(k: int, i: str) -> str | None:
            if not i:
                return None
            if i not in consts:
                return self.g.dtype(i)
            if generic or k in ints:
                code = TENSOR_CODES.get(consts[i].dtype)
                if code is None:
                    raise self.fail(f"constant {i!r} of dtype {consts[i].dtype}")
                return code
            return "f32"  # cast below

        dts = [dtype_of(k, i) for k, i in enumerate(inputs)]
        try:
            odt = out_dtype(op, [d for k, d in enumerate(dts) if k not in ints], attrs)
        except OpError as e:
            named = [f"{i!r} ({d})" for i, d in zip(inputs, dts) if i and d != "f32"]
            raise self.fail(f"{e}; inputs {', '.join(named) or 'float32'}") from None
        if all((not i) or i in consts for i in inputs):
            args = [None if not i else consts[i] if generic or k in ints
                    else consts[i].astype(np.float32) for k, i in enumerate(inputs)]  # fmt: skip
            val = np.asarray(REFERENCE[op](args, attrs))
            return self.add_const(out, val.astype(TENSOR_DTYPES[odt]).reshape(shape))
        for k, i in enumerate(inputs):
            if i and i in consts and not (generic or k in ints) and consts[i].dtype != np.float32:
                consts[i] = consts[i].astype(np.float32)
        name = self.node_name
        while name in self.used:  # one ONNX node may lower to several IR nodes
            name = f"{self.node_name}/{op}.{len(self.used)}"
        self.used.add(name)
        self.g.nodes.append(Node(op, name, list(inputs), [out], dict(attrs), [self.node_name]))
        self.g.shapes[out] = shape
        if odt != "f32":
            self.g.dtypes[out] = odt
        return out


_NO_ACT = {"act": "none", "act_args": [0.0, 0.0]}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(v):
    return v.decode() if isinstance(v, bytes) else v


def _spatial_pads(ctx: _Ctx, a: dict, in_hw, k, s, d) -> list[int]:
    """The begin pads of each spatial axis, then the end pads ([top, left, bottom, right]
    in 2-D), from pads / auto_pad."""
    nd = len(in_hw)
    auto = _decode(a.get("auto_pad", "NOTSET"))
    if auto in ("NOTSET", ""):
        p = [int(v) for v in a.get("pads", [0] * (2 * nd))]
        if len(p) != 2 * nd:
            raise ctx.fail(f"pads {p} for {nd} spatial axes")
        if min(p) < 0:
            raise ctx.fail(f"negative pads {p} are not supported")
        return p
    if auto == "VALID":
        return [0] * (2 * nd)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        heads, tails = [], []
        for x, kk, ss, dd in zip(in_hw, k, s, d):
            total = max((math.ceil(x / ss) - 1) * ss + (kk - 1) * dd + 1 - x, 0)
            small = total // 2
            head = small if auto == "SAME_UPPER" else total - small
            heads.append(head)
            tails.append(total - head)
        return heads + tails
    raise ctx.fail(f"auto_pad={auto!r}; supported: NOTSET, VALID, SAME_UPPER, SAME_LOWER")


def _act_node(act: str, args=(0.0, 0.0)):
    def handler(ctx: _Ctx, ins, outs, a):
        x = ins[0]
        if act == "leaky_relu":
            args_ = (float(a.get("alpha", 0.01)), 0.0)
        elif act == "hard_sigmoid":
            args_ = (float(a.get("alpha", 0.2)), float(a.get("beta", 0.5)))
        elif act == "clip" and _dtype_of(ctx, x) not in ("f32", "f16"):
            # integers: max and min with the bounds (integer binaries, exact)
            y = x
            for k, kind in ((1, "max"), (2, "min")):
                bound = ctx.opt_const(ins, k)
                if bound is not None:
                    v = np.asarray(bound, TENSOR_DTYPES[_dtype_of(ctx, x)])
                    c = ctx.add_const(ctx.fresh(f"{ctx.node_name}.{kind}"), v)
                    y = ctx.emit("binary", [y, c], ctx.fresh(outs[0] + "." + kind),
                                 {"kind": kind, **_NO_ACT})  # fmt: skip
            _identity(ctx, [y], outs[:1], a)
            return
        elif act == "clip":
            lo = ctx.opt_const(ins, 1)
            hi = ctx.opt_const(ins, 2)
            args_ = (
                float(lo) if lo is not None else float(np.finfo(np.float32).min),
                float(hi) if hi is not None else float(np.finfo(np.float32).max),
            )
        else:
            args_ = args
        ctx.emit("unary", [x], outs[0], {"act": act, "act_args": list(args_)})

    return handler


# ONNX's elementwise unary math -> the math op's function (kernels/mathfns.py) and the
# ONNX attributes that give its two args, with ONNX's defaults (float32 values, as the
# attributes are stored).
MATH_OPS: dict[str, tuple[str, tuple[tuple[str, float], ...]]] = {
    **{op: (op.lower(), ()) for op in (
        "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Sign",
        "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh",
        "Atanh", "Erf", "Softplus", "Softsign", "Mish")},
    "Elu": ("elu", (("alpha", 1.0),)),
    "Selu": ("selu", (("alpha", 1.6732631921768188), ("gamma", 1.0507010221481323))),
    "Celu": ("celu", (("alpha", 1.0),)),
    "ThresholdedRelu": ("thresholded_relu", (("alpha", 1.0),)),
    "Shrink": ("shrink", (("bias", 0.0), ("lambd", 0.5))),
    "Gelu": ("gelu", ()),  # approximate="tanh": gelu_tanh
}  # fmt: skip


def math_attrs(op: str, a: dict) -> dict:
    """The math node's attributes for ONNX op ``op`` with attributes ``a``."""
    fn, params = MATH_OPS[op]
    if op == "Gelu":
        approx = _decode(a.get("approximate", "none"))
        if approx not in ("none", "tanh"):
            raise ValueError(f"approximate={approx!r}; supported: none, tanh")
        fn = "gelu_tanh" if approx == "tanh" else fn
    args = [float(a.get(k, v)) for k, v in params] + [0.0, 0.0]
    return {"fn": fn, "args": args[:2]}


def _math(ctx: _Ctx, ins, outs, a):
    try:
        attrs = math_attrs(ctx.node.op_type, a)
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    ctx.emit("math", [ins[0]], outs[0], attrs)


def _as_2d(handler, weighted: bool):
    """A 1-D Conv, ConvTranspose or pool (x[N, C, L]) as its 2-D form over [N, C, 1, L]:
    the weight [Co, Ci, k] as [Co, Ci, 1, k], each spatial attribute given a leading 1
    (pads and output_padding a leading 0), the output reshaped back."""

    def wrapped(ctx: _Ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        if len(xs) != 3:
            return handler(ctx, ins, outs, a)
        x4 = ctx.fresh(ins[0] + ".2d")
        _reshape_to(ctx, ins[0], x4, (xs[0], xs[1], 1, xs[2]))
        ins = [x4, *ins[1:]]
        if weighted:
            w = ctx.const(ins[1], "weight")
            if w.ndim != 3:
                raise ctx.fail(f"weight of rank {w.ndim} for a 1-D convolution")
            ins[1] = ctx.add_const(ctx.fresh(ins[1] + ".2d"), w.reshape(*w.shape[:2], 1, -1))
        a = dict(a)
        for k in ("kernel_shape", "strides", "dilations"):
            if k in a:
                a[k] = [1, *a[k]]
        if "pads" in a:
            a["pads"] = [0, a["pads"][0], 0, a["pads"][1]]
        if "output_padding" in a:  # ConvTranspose
            a["output_padding"] = [0, *a["output_padding"]]
        if "output_shape" in a:
            a["output_shape"] = [1, *list(a["output_shape"])[-1:]]
        y4 = ctx.fresh(outs[0] + ".2d")
        more = [ctx.fresh(o + ".2d") if o else "" for o in outs[1:]]  # MaxPool's Indices
        handler(ctx, ins, [y4, *more], a)
        for o4, o in zip([y4, *more], outs):
            if o:
                s4 = ctx.shape(o4)
                _reshape_to(ctx, o4, o, (s4[0], s4[1], s4[3]))

    return wrapped


def _conv(ctx: _Ctx, ins, outs, a):
    x, wname = ins[0], ins[1]
    xs = ctx.shape(x)
    if len(xs) != 4:
        raise ctx.fail(f"input rank {len(xs)}; only 2-D convolutions (NCHW) are supported")
    w = ctx.const(wname, "weight").astype(np.float32)
    co, cg, kh, kw = w.shape
    g = int(a.get("group", 1))
    if xs[1] != cg * g:
        raise ctx.fail(f"input has {xs[1]} channels, weight expects {cg * g}")
    s = list(a.get("strides", [1, 1]))
    d = list(a.get("dilations", [1, 1]))
    pads = _spatial_pads(ctx, a, xs[2:], (kh, kw), s, d)
    b = ins[2] if len(ins) > 2 and ins[2] else ""
    if b:
        ctx.add_const(b, ctx.const(b, "bias").astype(np.float32).reshape(co))
    ctx.add_const(wname, w)
    op = "dwconv" if g > 1 and g == xs[1] == co else "conv"
    attrs = {
        "strides": s,
        "pads": pads,
        "dilations": d,
        "group": g,
        "act": "none",
        "act_args": [0.0, 0.0],
    }
    ctx.emit(op, [x, wname, b], outs[0], attrs)


def _conv_transpose(ctx: _Ctx, ins, outs, a):
    x, wname = ins[0], ins[1]
    xs = ctx.shape(x)
    if len(xs) != 4:
        raise ctx.fail(f"input rank {len(xs)}; only 2-D transposed convolutions (NCHW)")
    w = ctx.const(wname, "weight").astype(np.float32)
    g = int(a.get("group", 1))
    if w.ndim != 4 or w.shape[0] != xs[1] or xs[1] % g:
        raise ctx.fail(f"weights {list(w.shape)} for {xs[1]} channels in {g} groups")
    k = w.shape[2:]
    s = [int(v) for v in a.get("strides", [1, 1])]
    d = [int(v) for v in a.get("dilations", [1, 1])]
    op_ = [int(v) for v in a.get("output_padding", [0, 0])]
    full = [s[i] * (xs[2 + i] - 1) + op_[i] + (k[i] - 1) * d[i] + 1 for i in range(2)]
    auto = _decode(a.get("auto_pad", "NOTSET"))
    if "output_shape" in a:
        out = [int(v) for v in a["output_shape"]][-2:]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        out = [xs[2 + i] * s[i] for i in range(2)]
    else:
        out = None
    if out is not None:  # pads from the wanted size (the operator text's rule)
        total = [full[i] - out[i] for i in range(2)]
        upper = auto == "SAME_UPPER"
        # a canvas smaller than output_shape grows at its end (ORT: zero padding,
        # the extra rows and columns hold only the bias)
        begin = [0 if t < 0 else t // 2 if upper else t - t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
        if min(pads) < 0:  # larger than the canvas: zeros (and the bias) beyond it
            return _conv_transpose_beyond(ctx, ins, outs, a, w, g, s, d, pads, out)
    elif auto == "VALID" or auto in ("NOTSET", ""):
        pads = [int(v) for v in a.get("pads", [0, 0, 0, 0])] if auto != "VALID" else [0] * 4
        if len(pads) != 4 or min(pads) < 0:
            raise ctx.fail(f"pads {pads}")
        out = [full[0] - pads[0] - pads[2], full[1] - pads[1] - pads[3]]
    else:
        raise ctx.fail(f"auto_pad={auto!r}")
    b = ins[2] if len(ins) > 2 and ins[2] else ""
    if b:
        ctx.add_const(b, ctx.const(b, "bias").astype(np.float32).reshape(w.shape[1] * g))
    ctx.add_const(wname, w)
    attrs = {"strides": s, "pads": pads, "dilations": d, "group": g, "out_hw": out}
    ctx.emit("conv_transpose", [x, wname, b], outs[0], attrs)


def _conv_transpose_beyond(ctx: _Ctx, ins, outs, a, w, g, s, d, pads, out):
    """A ConvTranspose whose output_shape reaches past its canvas: the canvas (its
    non-negative pads cropped) without bias, zero-padded by the negative pads, then
    the bias added."""
    x, wname = ins[0], ins[1]
    crop = [max(p, 0) for p in pads]
    grow = [max(-p, 0) for p in pads]
    inner = [out[i] - grow[i] - grow[i + 2] for i in range(2)]
    ctx.add_const(wname, w)
    attrs = {"strides": s, "pads": crop, "dilations": d, "group": g, "out_hw": inner}
    y = ctx.emit("conv_transpose", [x, wname, ""], ctx.fresh(outs[0] + ".canvas"), attrs)
    n, c = ctx.shape(y)[:2]
    y = ctx.emit("pad", [y], ctx.fresh(outs[0] + ".grown") if len(ins) > 2 and ins[2] else outs[0],
                 {"pads": [0, 0, grow[0], grow[1], 0, 0, grow[2], grow[3]], "mode": "constant",
                  "value": 0.0})  # fmt: skip
    if len(ins) > 2 and ins[2]:
        bias = ctx.const(ins[2], "bias").astype(np.float32).reshape(1, c, 1, 1)
        b = ctx.add_const(ctx.fresh(ctx.node_name + ".bias"), bias)
        ctx.emit("binary", [y, b], outs[0], {"kind": "add", **_NO_ACT})


def _linear(ctx: _Ctx, x: str, w_nk: np.ndarray, bias: np.ndarray | None, out: str, base: str):
    wn = ctx.add_const(ctx.fresh(base + ".weight"), w_nk.astype(np.float32))
    bn = (
        ctx.add_const(ctx.fresh(base + ".bias"), bias.astype(np.float32))
        if bias is not None
        else ""
    )
    ctx.emit(
        "linear",
        [x, wn, bn],
        out,
        {"act": "none", "act_args": [0.0, 0.0]},
    )


def _gemm(ctx: _Ctx, ins, outs, a):
    A, B = ins[0], ins[1]
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    ta, tb = int(a.get("transA", 0)), int(a.get("transB", 0))
    if ta:
        A = ctx.emit("transpose", [A], ctx.fresh(A + ".T"), {"perm": [1, 0]})
    if B not in ctx.g.consts or (len(ins) > 2 and ins[2] and ins[2] not in ctx.g.consts):
        return _gemm_runtime(ctx, A, B, ins[2] if len(ins) > 2 else "", outs[0], alpha, beta, tb)
    w = ctx.const(B).astype(np.float32)
    w = (w if tb else w.T) * np.float32(alpha)  # -> [N, K]
    n = w.shape[0]
    c = ctx.opt_const(ins, 2)
    bias = None
    if c is not None:
        c = c.astype(np.float32) * np.float32(beta)
        if c.size == n and c.shape in ((n,), (1, n)):
            bias = c.reshape(n)
        elif c.size == 1:
            bias = np.full(n, c.reshape(()), np.float32)
    tmp = ctx.fresh(outs[0] + ".gemm") if c is not None and bias is None else outs[0]
    _linear(ctx, A, w, bias, tmp, ctx.node_name)
    if tmp != outs[0]:
        cn = ctx.add_const(ctx.fresh("gemm.C"), c)
        ctx.emit(
            "binary",
            [tmp, cn],
            outs[0],
            {"kind": "add", "act": "none", "act_args": [0.0, 0.0]},
        )


def _scaled(ctx: _Ctx, x: str, k: float, out: str) -> str:
    if k == 1.0:
        return x
    kn = ctx.add_const(ctx.fresh(ctx.node_name + ".k"), np.float32(k))
    return ctx.emit("binary", [x, kn], out, {"kind": "mul", **_NO_ACT})


def _gemm_runtime(ctx: _Ctx, A: str, B: str, C: str, out: str, alpha: float, beta: float,
                  tb: int) -> None:  # fmt: skip
    """Gemm whose B (or C) arrives at run time: a matmul of the two operands, alpha and
    beta as multiplies, C broadcast-added."""
    if tb:
        B = ctx.emit("transpose", [B], ctx.fresh(B + ".T"), {"perm": [1, 0]})
    has_c = bool(C) and beta != 0.0
    y = ctx.emit("matmul", [A, B], ctx.fresh(out) if has_c or alpha != 1.0 else out, _NO_ACT)
    y = _scaled(ctx, y, alpha, ctx.fresh(out) if has_c else out)
    if has_c:
        c = _scaled(ctx, C, beta, ctx.fresh(C + ".beta"))
        ctx.emit("binary", [y, c], out, {"kind": "add", **_NO_ACT})


def _matmul(ctx: _Ctx, ins, outs, a):
    A, B = ins
    sa, sb = ctx.shape(A), ctx.shape(B)
    if B in ctx.g.consts and len(sb) == 2 and len(sa) >= 1 and A not in ctx.g.consts:
        _linear(ctx, A, ctx.const(B).astype(np.float32).T, None, outs[0], ctx.node_name)
        return
    if len(sa) < 2 or len(sb) < 2:  # numpy's rule: a 1-D side is a row (left) or a column
        if not sa or not sb:
            raise ctx.fail("MatMul of a scalar")
        a2 = _reshaped(ctx, A, (1, sa[0])) if len(sa) == 1 else A
        b2 = _reshaped(ctx, B, (sb[0], 1)) if len(sb) == 1 else B
        if ctx.shape(a2)[-1] != ctx.shape(b2)[-2]:
            raise ctx.fail(f"inner dimensions differ: {sa} @ {sb}")
        y = ctx.emit("matmul", [a2, b2], ctx.fresh(outs[0] + ".2d"), dict(_NO_ACT))
        ys = list(ctx.shape(y))
        shape = ys[:-2] + ([ys[-2]] if len(sa) > 1 else []) + ([ys[-1]] if len(sb) > 1 else [])
        _reshape_to(ctx, y, outs[0], shape)
        return
    if sa[-1] != sb[-2]:
        raise ctx.fail(f"inner dimensions differ: {sa} @ {sb}")
    ctx.emit("matmul", [A, B], outs[0], {"act": "none", "act_args": [0.0, 0.0]})


def _reshaped(ctx: _Ctx, x: str, shape) -> str:
    if x in ctx.g.consts:
        return ctx.add_const(ctx.fresh(x + ".r"), np.asarray(ctx.g.consts[x]).reshape(shape))
    out = ctx.fresh(x + ".r")
    _reshape_to(ctx, x, out, shape)
    return out


def _tensor_code(elem_type: int) -> str | None:
    """The arena dtype code of an ONNX element type (None: not one edgepack holds)."""
    try:
        return TENSOR_CODES.get(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))
    except (KeyError, TypeError, ValueError):
        return None


def _cast(ctx: _Ctx, ins, outs, a):
    code = _tensor_code(int(a["to"]))
    if code is None:
        raise ctx.fail(f"to={onnx.TensorProto.DataType.Name(int(a['to']))} is not a dtype "
                       f"edgepack holds ({', '.join(sorted(TENSOR_DTYPES))})")  # fmt: skip
    ctx.emit("cast", [ins[0]], outs[0], {"to": code})


def _cast_like(ctx: _Ctx, ins, outs, a):
    t = ins[1]
    code = TENSOR_CODES.get(ctx.g.consts[t].dtype) if t in ctx.g.consts else ctx.g.dtype(t)
    if code is None:
        raise ctx.fail(f"target_type of dtype {ctx.g.consts[t].dtype}")
    ctx.emit("cast", [ins[0]], outs[0], {"to": code})


def _compare(kind: str):
    def handler(ctx: _Ctx, ins, outs, a):
        ctx.emit("compare", ins[:2], outs[0], {"kind": kind})

    return handler


def _logic(kind: str):
    def handler(ctx: _Ctx, ins, outs, a):
        ctx.emit("logic", ins[:1] if kind == "not" else ins[:2], outs[0], {"kind": kind})

    return handler


def _isnan(ctx: _Ctx, ins, outs, a):
    """IsNaN(x) = not (x == x): compare and logic, no kernel of its own."""
    same = ctx.emit("compare", [ins[0], ins[0]], ctx.fresh(outs[0] + ".same"), {"kind": "equal"})
    ctx.emit("logic", [same], outs[0], {"kind": "not"})


def _isinf(ctx: _Ctx, ins, outs, a):
    """IsInf(x) as compares with +inf / -inf (detect_positive / detect_negative)."""
    picks = []
    for sign, attr in ((1, "detect_positive"), (-1, "detect_negative")):
        if int(a.get(attr, 1)):
            dt = TENSOR_DTYPES[_dtype_of(ctx, ins[0])]
            inf = ctx.add_const(ctx.fresh(f"{ctx.node_name}.inf{sign}"),
                                np.asarray(sign * np.inf, dt))  # fmt: skip
            picks.append(ctx.emit("compare", [ins[0], inf], ctx.fresh(outs[0] + ".inf"),
                                  {"kind": "equal"}))  # fmt: skip
    if not picks:
        z = ctx.add_const(ctx.fresh(ctx.node_name + ".none"), np.zeros((), bool))
        return ctx.emit("expand", [z], outs[0], {"shape": list(ctx.shape(ins[0]))})
    if len(picks) == 1:
        return _identity(ctx, picks, outs, a)
    ctx.emit("logic", picks, outs[0], {"kind": "or"})


def _hardmax(ctx: _Ctx, ins, outs, a):
    """Hardmax: 1 at the first largest value along ``axis``, 0 elsewhere, as argmax ==
    an index ramp along the axis, cast to float."""
    xs = ctx.shape(ins[0])
    ax = int(a.get("axis", -1)) % len(xs)
    best = ctx.emit("argmax", [ins[0]], ctx.fresh(outs[0] + ".best"),
                    {"axis": ax, "keepdims": 1, "select_last": False, "min": False})  # fmt: skip
    ramp = np.arange(xs[ax], dtype=np.int64).reshape([-1 if i == ax else 1 for i in range(len(xs))])
    rn = ctx.add_const(ctx.fresh(ctx.node_name + ".ramp"), ramp)
    hit = ctx.emit("compare", [best, rn], ctx.fresh(outs[0] + ".hit"), {"kind": "equal"})
    ctx.emit("cast", [hit], outs[0], {"to": "f32"})


def _lp_norm(ctx: _Ctx, ins, outs, a):
    """LpNormalization: x / ||x||_p along ``axis`` (p 1 or 2), a reduce and a divide;
    where the norm is 0 the output is 0, as ONNX's reference gives it."""
    xs = ctx.shape(ins[0])
    ax, p = int(a.get("axis", -1)) % len(xs), int(a.get("p", 2))
    if p not in (1, 2):
        raise ctx.fail(f"p={p}; supported: 1, 2")
    norm = ctx.emit("reduce", [ins[0]], ctx.fresh(outs[0] + ".norm"),
                    {"kind": "l2" if p == 2 else "l1", "axes": [ax], "keepdims": 1})  # fmt: skip
    q = ctx.emit("binary", [ins[0], norm], ctx.fresh(outs[0] + ".q"), {"kind": "div", **_NO_ACT})
    zero = ctx.add_const(ctx.fresh(ctx.node_name + ".zero"), np.zeros((), np.float32))
    none = ctx.emit("compare", [norm, zero], ctx.fresh(outs[0] + ".none"), {"kind": "equal"})
    ctx.emit("where", [none, zero, q], outs[0], {})  # a zero vector stays zero (ONNX)


def _depth_space(to_space: bool):
    """DepthToSpace (DCR or CRD) and SpaceToDepth as a reshape, a transpose and a
    reshape, the layouts ONNX defines."""

    def handler(ctx: _Ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        if len(xs) != 4:
            raise ctx.fail(f"input rank {len(xs)}; expected NCHW")
        n, c, h, w = xs
        b = int(a["blocksize"])
        if to_space:
            if c % (b * b):
                raise ctx.fail(f"{c} channels for blocks of {b}x{b}")
            if _decode(a.get("mode", "DCR")) == "CRD":
                mid, perm = (n, c // (b * b), b, b, h, w), [0, 1, 4, 2, 5, 3]
            else:
                mid, perm = (n, b, b, c // (b * b), h, w), [0, 3, 4, 1, 5, 2]
            final = (n, c // (b * b), h * b, w * b)
        else:
            if h % b or w % b:
                raise ctx.fail(f"{h}x{w} for blocks of {b}")
            mid, perm = (n, c, h // b, b, w // b, b), [0, 3, 5, 1, 2, 4]
            final = (n, c * b * b, h // b, w // b)
        r1 = ctx.fresh(outs[0] + ".blocks")
        _reshape_to(ctx, ins[0], r1, mid)
        t = ctx.emit("transpose", [r1], ctx.fresh(outs[0] + ".moved"), {"perm": perm})
        _reshape_to(ctx, t, outs[0], final)

    return handler


def _dtype_of(ctx: _Ctx, name: str) -> str:
    if name in ctx.g.consts:
        return TENSOR_CODES.get(ctx.g.consts[name].dtype, "?")
    return ctx.g.dtype(name)


def _attention(ctx: _Ctx, ins, outs, a):
    """ONNX Attention (opset 23/24) composed from matmul, softmax, binary and the moves,
    as ONNX's reference computes it: 3-D inputs split into heads, past key/value
    concatenated in front, grouped kv heads repeated, Q and K each scaled by
    sqrt(scale), softcap, the mask (bool: -inf where False) and the causal bias added,
    softmax, rows that every key masks set to 0, times V. nonpad_kv_seqlen (keys
    from it on masked per batch, the causal frontier at it) and the qk_matmul_output
    output (mode 0 or 1: the softcapped scores; 2: with the bias added; 3: after the
    softmax) as onnx's reference.
    float16 inputs are computed in float32 between casts."""
    get = lambda i: ins[i] if len(ins) > i and ins[i] else ""  # noqa: E731
    q, k, v, mask, past_k, past_v = (get(i) for i in range(6))
    nonpad = get(6)
    if ctx.g.dtype(q) == "f16":
        ins32 = [t if not t or i == 6 or (i == 3 and _dtype_of(ctx, t) == "bool") else
                 ctx.emit("cast", [t], ctx.fresh(t + ".f32"), {"to": "f32"})
                 for i, t in enumerate(ins)]  # fmt: skip
        outs32 = [ctx.fresh(o + ".f32") if o else "" for o in outs]
        _attention(ctx, ins32, outs32, a)
        for o, o32 in zip(outs, outs32):
            if o:
                ctx.emit("cast", [o32], o, {"to": "f16"})
        return
    qk_out = outs[3] if len(outs) > 3 and outs[3] else ""
    mode = int(a.get("qk_matmul_output_mode", 0))
    if nonpad and (past_k or past_v):
        raise ctx.fail("nonpad_kv_seqlen with past key/value")
    if any(int(a.get(w, -1)) >= 0 for w in ("left_window_size", "right_window_size")):
        raise ctx.fail("sliding windows are not supported")
    qs = ctx.shape(q)
    f = ctx.fresh

    def heads(x: str, n: int | None) -> str:
        xs = ctx.shape(x)
        if len(xs) == 4:
            return x
        if n is None or xs[2] % n:
            raise ctx.fail(f"3-D input {list(xs)} needs its head count")
        r = f(x + ".heads")
        _reshape_to(ctx, x, r, (xs[0], xs[1], n, xs[2] // n))
        return ctx.emit("transpose", [r], f(x + ".bhsd"), {"perm": [0, 2, 1, 3]})

    hq, hkv = a.get("q_num_heads"), a.get("kv_num_heads")
    q4, k4, v4 = heads(q, hq), heads(k, hkv), heads(v, hkv)
    if past_k or past_v:
        if not (past_k and past_v):
            raise ctx.fail("past_key and past_value come together")
        k4 = ctx.emit("concat", [past_k, k4], f(k + ".all"), {"axis": 2})
        v4 = ctx.emit("concat", [past_v, v4], f(v + ".all"), {"axis": 2})
    for out, t in zip(outs[1:3], (k4, v4)):  # present_key / present_value
        if out:
            _identity(ctx, [t], [out], {})
    b, nq, s_len, d = ctx.shape(q4)
    nk, l_len = ctx.shape(k4)[1], ctx.shape(k4)[2]
    if nq != nk:
        if nq % nk:
            raise ctx.fail(f"{nq} query heads over {nk} kv heads")
        rep = []
        for t in (k4, v4):
            ts = ctx.shape(t)
            r5 = f(t + ".g")
            _reshape_to(ctx, t, r5, (ts[0], ts[1], 1, ts[2], ts[3]))
            e = ctx.emit("expand", [r5], f(t + ".rep"),
                         {"shape": [ts[0], ts[1], nq // nk, ts[2], ts[3]]})  # fmt: skip
            r4 = f(t + ".q")
            _reshape_to(ctx, e, r4, (ts[0], nq, ts[2], ts[3]))
            rep.append(r4)
        k4, v4 = rep
    scale = a.get("scale")
    root = np.float32(np.sqrt(float(scale) if scale is not None else 1.0 / np.sqrt(d)))
    rc = ctx.add_const(f(ctx.node_name + ".sqrt_scale"), root)
    qsc = ctx.emit("binary", [q4, rc], f(q + ".scaled"), {"kind": "mul", **_NO_ACT})
    ksc = ctx.emit("binary", [k4, rc], f(k + ".scaled"), {"kind": "mul", **_NO_ACT})
    kt = ctx.emit("transpose", [ksc], f(k + ".T"), {"perm": [0, 1, 3, 2]})
    sc = ctx.emit("matmul", [qsc, kt], f(ctx.node_name + ".qk"), dict(_NO_ACT))
    cap = float(a.get("softcap", 0.0) or 0.0)
    if cap > 0:
        cn = ctx.add_const(f(ctx.node_name + ".cap"), np.float32(cap))
        t = ctx.emit("binary", [sc, cn], f(ctx.node_name + ".qk_c"), {"kind": "div", **_NO_ACT})
        t = ctx.emit("unary", [t], f(ctx.node_name + ".qk_t"),
                     {"act": "tanh", "act_args": [0.0, 0.0]})  # fmt: skip
        sc = ctx.emit("binary", [t, cn], f(ctx.node_name + ".qk_s"), {"kind": "mul", **_NO_ACT})
    raw = sc  # qk_matmul_output modes 0 and 1: the (softcapped) scores
    bias = ""
    if mask:
        if ctx.shape(mask)[-1] != l_len:
            raise ctx.fail(f"a mask of {ctx.shape(mask)[-1]} keys for {l_len}")
        const = ctx.g.consts.get(mask)
        if ctx.g.dtype(mask) == "bool" if const is None else const.dtype == bool:
            zero = ctx.add_const(f(ctx.node_name + ".zero"), np.zeros((), np.float32))
            ninf = ctx.add_const(f(ctx.node_name + ".ninf"), np.float32(-np.inf))
            bias = ctx.emit("where", [mask, zero, ninf], f(ctx.node_name + ".bias"), {})
        else:
            bias = mask
    def add_bias(bias: str, cz: str) -> str:
        return cz if not bias else ctx.emit("binary", [bias, cz], f(ctx.node_name + ".bc"),
                                            {"kind": "add", **_NO_ACT})  # fmt: skip

    def where_bias(allowed: str) -> str:
        zero = ctx.add_const(f(ctx.node_name + ".z"), np.zeros((), np.float32))
        ninf = ctx.add_const(f(ctx.node_name + ".ni"), np.float32(-np.inf))
        return ctx.emit("where", [allowed, zero, ninf], f(ctx.node_name + ".nb"), {})

    nb = ""
    if nonpad:  # [B] valid keys per batch, as [B, 1, 1, 1]
        nb = f(nonpad + ".b")
        _reshape_to(ctx, nonpad, nb, (b, 1, 1, 1))
        if ctx.g.dtype(nb) != "i64":
            nb = ctx.emit("cast", [nb], f(nonpad + ".i64"), {"to": "i64"})
    if int(a.get("is_causal", 0)):
        if nonpad:  # key j allowed for query i while j - i + S <= nonpad[b]
            dist = np.arange(l_len)[None, :] - np.arange(s_len)[:, None] + s_len
            dn = ctx.add_const(f(ctx.node_name + ".dist"), dist.reshape(1, 1, s_len, l_len))
            ok = ctx.emit("compare", [dn, nb], f(ctx.node_name + ".causal_ok"),
                          {"kind": "less_equal"})  # fmt: skip
            bias = add_bias(bias, where_bias(ok))
        else:
            off = ctx.shape(past_k)[2] if past_k else 0  # the frontier: after the past keys
            allowed = np.arange(l_len)[None, :] <= np.arange(s_len)[:, None] + off
            cz = ctx.add_const(f(ctx.node_name + ".causal"),
                               np.where(allowed, 0.0, -np.inf).astype(np.float32))  # fmt: skip
            bias = add_bias(bias, cz)
    if nonpad:  # keys from nonpad[b] on are padding
        keys = ctx.add_const(f(ctx.node_name + ".keys"), np.arange(l_len).reshape(1, 1, 1, -1))
        ok = ctx.emit("compare", [keys, nb], f(ctx.node_name + ".pad_ok"), {"kind": "less"})
        bias = add_bias(bias, where_bias(ok))
    if bias:
        sc = ctx.emit("binary", [sc, bias], f(ctx.node_name + ".qkb"), {"kind": "add", **_NO_ACT})
    if qk_out and mode in (0, 1, 2):  # as onnx's reference (1.23): mode 2 holds the bias
        _identity(ctx, [sc if mode == 2 else raw], [qk_out], {})
    p = ctx.emit("softmax", [sc], f(ctx.node_name + ".p"), {"axis": 3})
    if bias:  # rows every key masks: 0 (the softmax of all -inf is NaN)
        last = len(ctx.shape(bias)) - 1
        top = ctx.emit("reduce", [bias], f(ctx.node_name + ".top"),
                       {"kind": "max", "axes": [last], "keepdims": 1})  # fmt: skip
        ninf = ctx.add_const(f(ctx.node_name + ".ninf2"), np.float32(-np.inf))
        dead = ctx.emit("compare", [top, ninf], f(ctx.node_name + ".dead"), {"kind": "equal"})
        zero = ctx.add_const(f(ctx.node_name + ".zero2"), np.zeros((), np.float32))
        p = ctx.emit("where", [dead, zero, p], f(ctx.node_name + ".p0"), {})
    if qk_out and mode == 3:
        _identity(ctx, [p], [qk_out], {})
    elif qk_out and mode not in (0, 1, 2):
        raise ctx.fail(f"qk_matmul_output_mode={mode}; supported: 0-3")
    if len(qs) == 4:
        ctx.emit("matmul", [p, v4], outs[0], dict(_NO_ACT))
        return
    y4 = ctx.emit("matmul", [p, v4], f(outs[0] + ".bhsd"), dict(_NO_ACT))
    yt = ctx.emit("transpose", [y4], f(outs[0] + ".bshd"), {"perm": [0, 2, 1, 3]})
    _reshape_to(ctx, yt, outs[0], (b, s_len, nq * ctx.shape(v4)[3]))


def _where(ctx: _Ctx, ins, outs, a):
    ctx.emit("where", ins[:3], outs[0], {})


def _binary(kind: str):
    def handler(ctx: _Ctx, ins, outs, a):
        x, y = ins
        ctx.emit(
            "binary",
            [x, y],
            outs[0],
            {"kind": kind, "act": "none", "act_args": [0.0, 0.0]},
        )

    return handler


def _variadic(kind: str, mean: bool = False):
    """Max, Min, Sum, Mean: a chain of binary nodes over the (broadcast) inputs."""

    def handler(ctx: _Ctx, ins, outs, a):
        parts = [i for i in ins if i]
        if not parts:
            raise ctx.fail("no inputs")
        if len(parts) == 1 and not mean:
            return _identity(ctx, parts, outs, a)
        acc = parts[0]
        for j, p in enumerate(parts[1:]):
            last = j == len(parts) - 2 and not mean
            acc = ctx.emit("binary", [acc, p], outs[0] if last else ctx.fresh(outs[0]),
                           {"kind": kind, "act": "none", "act_args": [0.0, 0.0]})  # fmt: skip
        if mean:
            n = ctx.add_const(ctx.fresh(ctx.node_name + ".n"), np.float32(1.0 / len(parts)))
            ctx.emit("binary", [acc, n], outs[0],
                     {"kind": "mul", "act": "none", "act_args": [0.0, 0.0]})  # fmt: skip

    return handler


def _pool_out(ctx, a, xs, k, s, d, pads):
    ceil = int(a.get("ceil_mode", 0))
    nd = len(xs) - 2
    out = []
    for i in range(nd):
        span = xs[2 + i] + pads[i] + pads[i + nd] - ((k[i] - 1) * d[i] + 1)
        if span < 0:
            raise ctx.fail(f"a window of {k} (dilations {d}) is larger than the padded input")
        o = (-(-span // s[i]) if ceil else span // s[i]) + 1
        if ceil and (o - 1) * s[i] >= xs[2 + i] + pads[i]:
            o -= 1  # the last window may not start inside the bottom/right padding
        out.append(o)
    return out


def _pool(kind: str):
    """MaxPool / AveragePool / LpPool. 2-D max and average pools without dilations (in
    average) take the fast 2-D kernels; the rest (1-D LpPool, 3-D, dilated average)
    the N-D pool (kernels/generic.py pool_nd_step)."""

    def handler(ctx: _Ctx, ins, outs, a):
        x = ins[0]
        xs = ctx.shape(x)
        nd = len(xs) - 2
        if nd < 1:
            raise ctx.fail(f"input rank {len(xs)}; expected N, C and spatial axes")
        indices = outs[1] if len(outs) > 1 and outs[1] else ""
        k = list(a["kernel_shape"])
        s = list(a.get("strides", [1] * nd))
        d = list(a.get("dilations", [1] * nd))
        if not len(k) == len(s) == len(d) == nd:
            raise ctx.fail(f"kernel {k}, strides {s}, dilations {d} for {nd} spatial axes")
        pads = _spatial_pads(ctx, a, xs[2:], k, s, d)
        out = _pool_out(ctx, a, xs, k, s, d, pads)
        if indices:  # MaxPool's Indices: the flat index of each window's first maximum
            kind_i = "argmax_col" if int(a.get("storage_order", 0)) else "argmax"
            ctx.emit("pool_nd", [x], indices, {"kind": kind_i, "kernel": k, "strides": s,
                                               "dilations": d, "pads": pads, "out": out,
                                               "count_include_pad": 0, "p": 2})  # fmt: skip
        if nd != 2 or kind == "lp" or (kind == "avg" and d != [1, 1]):
            attrs = {"kind": kind, "kernel": k, "strides": s, "dilations": d, "pads": pads,
                     "out": out, "count_include_pad": int(a.get("count_include_pad", 0)),
                     "p": int(a.get("p", 2))}  # fmt: skip
            return ctx.emit("pool_nd", [x], outs[0], attrs)
        oh, ow = out
        attrs = {"kernel": k, "strides": s, "pads": pads, "out_hw": [oh, ow]}
        if kind == "max":
            attrs["dilations"] = d
        else:
            attrs["count_include_pad"] = int(a.get("count_include_pad", 0))
        dt = ctx.g.dtype(x)
        if kind == "max" and dt in ("u8", "i8"):
            # quantized values (a QOperator model's MaxPool): exact in float32, so the
            # float pool between two casts
            f = ctx.emit("cast", [x], ctx.fresh(x + ".f32"), {"to": "f32"})
            y = ctx.emit("maxpool", [f], ctx.fresh(outs[0] + ".f32"), attrs)
            return ctx.emit("cast", [y], outs[0], {"to": dt})
        ctx.emit(kind + "pool", [x], outs[0], attrs)

    return handler


def _global_avg(ctx: _Ctx, ins, outs, a):
    ctx.emit("global_avgpool", [ins[0]], outs[0], {})


def _argmax(is_min: bool):
    def handler(ctx: _Ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        ax = int(a.get("axis", 0))
        if not -len(xs) <= ax < len(xs):
            raise ctx.fail(f"axis {ax} out of range for rank {len(xs)}")
        attrs = {"axis": ax % len(xs), "keepdims": int(a.get("keepdims", 1)),
                 "select_last": bool(a.get("select_last_index", 0)), "min": is_min}  # fmt: skip
        ctx.emit("argmax", [ins[0]], outs[0], attrs)

    return handler


def _slice_attrs(xs, spans: dict[int, tuple[int, int, int]]) -> dict:
    """The slice node's attributes: each axis' (start, end, step) with ONNX's clamping,
    which is Python's (slice.indices); axes not named are whole."""
    starts, steps, sizes = [], [], []
    for ax, d in enumerate(xs):
        r = range(*slice(*spans.get(ax, (0, d, 1))).indices(d))
        starts.append(r.start if len(r) else 0)
        steps.append(r.step)
        sizes.append(len(r))
    return {"starts": starts, "steps": steps, "sizes": sizes}


def _slice(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    starts, ends = ctx.const(ins[1], "starts"), ctx.const(ins[2], "ends")
    axes = ctx.opt_const(ins, 3)
    steps = ctx.opt_const(ins, 4)
    axes = range(len(starts)) if axes is None else [int(v) for v in axes]
    steps = [1] * len(starts) if steps is None else [int(v) for v in steps]
    spans = {}
    for b, e, ax, st in zip(starts, ends, axes, steps):
        if not -len(xs) <= ax < len(xs) or st == 0:
            raise ctx.fail(f"axis {ax}, step {st} for rank {len(xs)}")
        spans[ax % len(xs)] = (int(b), int(e), st)
    ctx.emit("slice", [ins[0]], outs[0], _slice_attrs(xs, spans))


def _split(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    ax = int(a.get("axis", 0))
    if not -len(xs) <= ax < len(xs):
        raise ctx.fail(f"axis {ax} out of range for rank {len(xs)}")
    ax %= len(xs)
    given = ctx.opt_const(ins, 1) if ctx.opset >= 13 else a.get("split")
    if given is not None and len(given):
        sizes = [int(v) for v in np.asarray(given).reshape(-1)]
    else:  # equal parts (opset 18: num_outputs, the last one smaller)
        n = int(a.get("num_outputs", len(outs)))
        part = -(-xs[ax] // n)
        sizes = [min(part, xs[ax] - i * part) for i in range(n)]
    if len(sizes) != len(outs) or sum(sizes) != xs[ax] or min(sizes) < 0:
        raise ctx.fail(f"split sizes {sizes} of an axis of {xs[ax]} into {len(outs)} outputs")
    start = 0
    for out, n in zip(outs, sizes):
        if out:
            ctx.emit("slice", [ins[0]], out, _slice_attrs(xs, {ax: (start, start + n, 1)}))
        start += n


def _resize(ctx: _Ctx, ins, outs, a):
    """Resize (opset 11-19) with constant scales or sizes: one resample node per axis
    whose size or coordinates change (packager/resize.py makes the taps)."""
    from . import resize as rz

    xs = ctx.shape(ins[0])
    r = len(xs)
    mode = _decode(a.get("mode", "nearest"))
    transform = _decode(a.get("coordinate_transformation_mode", "half_pixel"))
    nearest = _decode(a.get("nearest_mode", "round_prefer_floor"))
    for what, v, known in (
        ("mode", mode, rz.MODES),
        ("coordinate_transformation_mode", transform, rz.TRANSFORMS),
        ("nearest_mode", nearest, rz.NEAREST),
    ):
        if v not in known:
            raise ctx.fail(f"{what}={v!r}; supported: {', '.join(known)}")
    axes = [int(v) % r for v in a.get("axes", range(r))]
    roi = ctx.opt_const(ins, 1)
    scales = ctx.opt_const(ins, 2)
    sizes = ctx.opt_const(ins, 3)
    scales = None if scales is None or scales.size == 0 else [float(v) for v in scales]
    sizes = None if sizes is None or sizes.size == 0 else [int(v) for v in sizes]
    if (scales is None) == (sizes is None):
        raise ctx.fail("give exactly one of scales and sizes, as constants")
    given = scales if scales is not None else sizes
    if len(given) != len(axes):
        raise ctx.fail(f"{len(given)} scales/sizes for axes {axes}")
    policy = _decode(a.get("keep_aspect_ratio_policy", "stretch"))
    scale = dict.fromkeys(range(r), 1.0)
    out = list(xs)
    if sizes is not None:
        ratios = {ax: n / xs[ax] for ax, n in zip(axes, sizes)}
        if policy in ("not_larger", "not_smaller"):
            k = (min if policy == "not_larger" else max)(ratios.values())
            ratios = dict.fromkeys(axes, k)
            sizes = [int(math.floor(k * xs[ax] + 0.5)) for ax in axes]
        elif policy != "stretch":
            raise ctx.fail(f"keep_aspect_ratio_policy={policy!r}")
        for ax, n in zip(axes, sizes):
            scale[ax], out[ax] = ratios[ax], n
    else:
        for ax, sc in zip(axes, scales):
            if sc <= 0:
                raise ctx.fail(f"scale {sc} must be positive")
            scale[ax] = sc
    rois = {}
    if transform == "tf_crop_and_resize":
        if roi is None or roi.size != 2 * len(axes):
            raise ctx.fail("tf_crop_and_resize needs a constant roi (starts, then ends)")
        rv = [float(v) for v in roi.reshape(-1)]
        rois = {ax: (rv[i], rv[i + len(axes)]) for i, ax in enumerate(axes)}
    if scales is not None:
        for ax in axes:
            lo, hi = rois.get(ax, (0.0, 1.0))
            out[ax] = int(math.floor(xs[ax] * (hi - lo) * scale[ax]))
    if min(out) < 1:
        raise ctx.fail(f"output shape {out}")
    x = ins[0]
    changed = []
    for ax in axes:
        idx, w = rz.axis_taps(
            xs[ax], out[ax], scale[ax], mode, transform, nearest,
            float(a.get("cubic_coeff_a", -0.75)), bool(a.get("exclude_outside", 0)),
            bool(a.get("antialias", 0)), rois.get(ax, (0.0, 1.0)),
        )  # fmt: skip
        if not rz.is_identity(idx, w, xs[ax]):
            changed.append((ax, idx, w))
    if not changed:
        return _identity(ctx, [x], outs, a)
    extra = float(a.get("extrapolation_value", 0.0)) if transform == "tf_crop_and_resize" else 0.0
    last = outs[0] if extra == 0.0 else ctx.fresh(outs[0] + ".resampled")
    for j, (ax, idx, w) in enumerate(changed):
        iname = ctx.add_const(ctx.fresh(f"{ctx.node_name}.idx{ax}"), idx)
        wname = ctx.add_const(ctx.fresh(f"{ctx.node_name}.w{ax}"), w)
        dst = last if j == len(changed) - 1 else ctx.fresh(f"{outs[0]}.axis{ax}")
        x = ctx.emit("resample", [x, iname, wname], dst, {"axis": ax})
    if extra != 0.0:  # outside the crop's input (all-zero taps on some axis): the value
        outside = np.zeros([1] * len(xs), bool)
        for ax, _, w in changed:
            shape = [1] * len(xs)
            shape[ax] = out[ax]
            outside = outside | (np.abs(w).sum(axis=1) == 0).reshape(shape)
        m = ctx.add_const(ctx.fresh(ctx.node_name + ".outside"), outside)
        v = ctx.add_const(ctx.fresh(ctx.node_name + ".extrapolation"), np.float32(extra))
        ctx.emit("where", [m, v, x], outs[0], {})


def _reshape_to(ctx: _Ctx, x: str, out: str, shape) -> None:
    ctx.emit("reshape", [x], out, {"shape": [int(d) for d in shape]})


def _reshape(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    target = [int(v) for v in ctx.const(ins[1], "shape")]
    allowzero = int(a.get("allowzero", 0))
    shape = [xs[i] if (v == 0 and not allowzero) else v for i, v in enumerate(target)]
    if shape.count(-1) > 1:
        raise ctx.fail(f"shape {target} has more than one -1")
    if -1 in shape:
        known = int(np.prod([v for v in shape if v != -1]))
        shape[shape.index(-1)] = int(np.prod(xs)) // max(known, 1)
    if int(np.prod(shape)) != int(np.prod(xs)):
        raise ctx.fail(f"cannot reshape {list(xs)} to {target}")
    _reshape_to(ctx, ins[0], outs[0], shape)


def _flatten(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    ax = int(a.get("axis", 1))
    if not -len(xs) <= ax <= len(xs):
        raise ctx.fail(f"axis {ax} out of range for rank {len(xs)}")
    ax = ax + len(xs) if ax < 0 else ax  # -1 is the last axis (not rank + 1 - 1)
    _reshape_to(ctx, ins[0], outs[0], (int(np.prod(xs[:ax])), int(np.prod(xs[ax:]))))


def _axes(ctx: _Ctx, ins, a, rank: int, attr_until: int) -> list[int] | None:
    if ctx.opset < attr_until:
        ax = a.get("axes")
    else:
        ax = ctx.opt_const(ins, 1)
    if ax is None:
        return None
    vals = [int(v) for v in np.asarray(ax).reshape(-1)]
    if any(not -rank <= v < rank for v in vals):
        raise ctx.fail(f"axes {vals} out of range for rank {rank}")
    return sorted(v % rank for v in vals)


def _squeeze(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    axes = _axes(ctx, ins, a, len(xs), 13)
    if axes is None:
        axes = [i for i, d in enumerate(xs) if d == 1]
    if any(xs[i] != 1 for i in axes):
        raise ctx.fail(f"cannot squeeze axes {axes} of shape {list(xs)}")
    _reshape_to(ctx, ins[0], outs[0], [d for i, d in enumerate(xs) if i not in axes])


def _unsqueeze(ctx: _Ctx, ins, outs, a):
    xs = list(ctx.shape(ins[0]))
    raw = np.asarray(ctx.const(ins[1], "axes")).reshape(-1)  # an input since opset 13
    rank = len(xs) + raw.size
    for ax in sorted(int(v) % rank for v in raw):
        xs.insert(ax, 1)
    _reshape_to(ctx, ins[0], outs[0], xs)


def _identity(ctx: _Ctx, ins, outs, a):
    _reshape_to(ctx, ins[0], outs[0], ctx.shape(ins[0]))


def _transpose(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    perm = [int(p) for p in a.get("perm", list(range(len(xs)))[::-1])]
    ctx.emit("transpose", [ins[0]], outs[0], {"perm": perm})


def _concat(ctx: _Ctx, ins, outs, a):
    shapes = [ctx.shape(i) for i in ins if i]
    ax = int(a["axis"]) % len(shapes[0])
    out = list(shapes[0])
    out[ax] = sum(s[ax] for s in shapes)
    ctx.emit("concat", [i for i in ins if i], outs[0], {"axis": ax})


def _softmax(log: bool):
    def handler(ctx: _Ctx, ins, outs, a):
        xs = ctx.shape(ins[0])
        attrs = {"axis": int(a.get("axis", -1)) % len(xs), **({"log": True} if log else {})}
        ctx.emit("softmax", [ins[0]], outs[0], attrs)

    return handler


def _reduce_mean(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    axes = _axes(ctx, ins, a, len(xs), 18)
    if axes is None or axes == []:
        if int(a.get("noop_with_empty_axes", 0)):
            return _identity(ctx, ins, outs, a)
        axes = list(range(len(xs)))
    kd = int(a.get("keepdims", 1))
    ctx.emit("reduce_mean", [ins[0]], outs[0], {"axes": axes, "keepdims": kd})


# ONNX Reduce* -> the reduce op's kind, and the opset from which axes is an input
REDUCE_OPS = {"ReduceSum": ("sum", 13), "ReduceMax": ("max", 18), "ReduceMin": ("min", 18),
              "ReduceProd": ("prod", 18), "ReduceL1": ("l1", 18), "ReduceL2": ("l2", 18),
              "ReduceSumSquare": ("sum_square", 18), "ReduceLogSum": ("log_sum", 18),
              "ReduceLogSumExp": ("log_sum_exp", 18)}  # fmt: skip


def _reduce(ctx: _Ctx, ins, outs, a):
    kind, since = REDUCE_OPS[ctx.node.op_type]
    xs = ctx.shape(ins[0])
    if _dtype_of(ctx, ins[0]) == "bool" and kind in ("max", "min"):  # any / all
        f = ctx.emit("cast", [ins[0]], ctx.fresh(ins[0] + ".f32"), {"to": "f32"})
        y = ctx.fresh(outs[0] + ".f32")
        _reduce(ctx, [f, *ins[1:]], [y], a)
        return ctx.emit("cast", [y], outs[0], {"to": "bool"})
    axes = _axes(ctx, ins, a, len(xs), since)
    if not axes:
        if int(a.get("noop_with_empty_axes", 0)):
            return _identity(ctx, ins, outs, a)
        axes = list(range(len(xs)))
    ctx.emit("reduce", [ins[0]], outs[0],
             {"kind": kind, "axes": axes, "keepdims": int(a.get("keepdims", 1))})  # fmt: skip


def _global_max(ctx: _Ctx, ins, outs, a):
    r = len(ctx.shape(ins[0]))
    ctx.emit("reduce", [ins[0]], outs[0],
             {"kind": "max", "axes": list(range(2, r)), "keepdims": 1})  # fmt: skip


def _gather(ctx: _Ctx, ins, outs, a):
    """Gather of a run-time tensor at constant indices: a slice when they step evenly
    (a class token's row 0, a stride), else one-tap resample rows (weight 1: an exact
    copy, -0.0 read as 0.0); then the indices' shape in place of the axis."""
    xs = ctx.shape(ins[0])
    ax = int(a.get("axis", 0))
    if not -len(xs) <= ax < len(xs):
        raise ctx.fail(f"axis {ax} out of range for rank {len(xs)}")
    ax %= len(xs)
    if ins[1] not in ctx.g.consts or ctx.g.dtype(ins[0]) != "f32" or ins[0] in ctx.g.consts:
        return ctx.emit("take", ins[:2], outs[0], {"axis": ax})  # any dtype, run-time indices
    ind = np.asarray(ctx.const(ins[1], "indices"))
    if ind.dtype.kind not in "iu":
        raise ctx.fail(f"indices of dtype {ind.dtype}")
    flat = ind.reshape(-1).astype(np.int64)
    if flat.size == 0 or flat.min() < -xs[ax] or flat.max() >= xs[ax]:
        raise ctx.fail(f"indices {flat.tolist()[:8]} out of range for an axis of {xs[ax]}")
    flat = np.where(flat < 0, flat + xs[ax], flat)
    step = int(flat[1] - flat[0]) if flat.size > 1 else 1
    picked = ctx.fresh(outs[0] + ".picked")
    if step != 0 and np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        attrs = _slice_attrs(xs, {})
        attrs["starts"][ax], attrs["steps"][ax], attrs["sizes"][ax] = int(flat[0]), step, flat.size
        ctx.emit("slice", [ins[0]], picked, attrs)
    else:
        iname = ctx.add_const(ctx.fresh(ctx.node_name + ".idx"), flat.astype(np.int32)[:, None])
        wname = ctx.add_const(ctx.fresh(ctx.node_name + ".w"), np.ones((flat.size, 1), np.float32))
        ctx.emit("resample", [ins[0], iname, wname], picked, {"axis": ax})
    _reshape_to(ctx, picked, outs[0], (*xs[:ax], *ind.shape, *xs[ax + 1 :]))


def _axis_of(ctx: _Ctx, x: str, a: dict, default: int = 0) -> int:
    rank = len(ctx.shape(x))
    ax = int(a.get("axis", default))
    if not -rank <= ax < rank:
        raise ctx.fail(f"axis {ax} out of range for rank {rank}")
    return ax % rank


def _gather_elements(ctx: _Ctx, ins, outs, a):
    ctx.emit("gather_elements", ins[:2], outs[0], {"axis": _axis_of(ctx, ins[0], a)})


def _reduction(ctx: _Ctx, a: dict) -> str:
    r = _decode(a.get("reduction", "none"))
    if r not in ("none", "add", "mul", "max", "min"):
        raise ctx.fail(f"reduction={r!r}; supported: none, add, mul, max, min")
    return r


def _scatter_elements(ctx: _Ctx, ins, outs, a):
    ctx.emit("scatter_elements", ins[:3], outs[0],
             {"axis": _axis_of(ctx, ins[0], a), "reduction": _reduction(ctx, a)})  # fmt: skip


def _scatter_nd(ctx: _Ctx, ins, outs, a):
    ctx.emit("scatter_nd", ins[:3], outs[0], {"reduction": _reduction(ctx, a)})


def _gather_nd(ctx: _Ctx, ins, outs, a):
    ctx.emit("gather_nd", ins[:2], outs[0], {"batch_dims": int(a.get("batch_dims", 0))})


def _grid_sample(ctx: _Ctx, ins, outs, a):
    mode = _decode(a.get("mode", "linear" if ctx.opset >= 20 else "bilinear"))
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)  # opset 16's names
    attrs = {"mode": mode, "padding_mode": _decode(a.get("padding_mode", "zeros")),
             "align_corners": int(a.get("align_corners", 0))}  # fmt: skip
    ctx.emit("grid_sample", ins[:2], outs[0], attrs)


def _topk(ctx: _Ctx, ins, outs, a):
    """TopK: the indices node (int64), and the values a gather_elements of x at them.
    ``sorted`` 0 allows any order; the sorted one is given."""
    ax = _axis_of(ctx, ins[0], a, -1)
    k = int(np.asarray(ctx.const(ins[1], "k")).reshape(-1)[0]) if len(ins) > 1 else int(a["k"])
    vals, idx = outs[0], outs[1] if len(outs) > 1 and outs[1] else ctx.fresh(outs[0] + ".idx")
    ctx.emit("topk", [ins[0]], idx, {"axis": ax, "k": k, "largest": int(a.get("largest", 1))})
    if vals:
        ctx.emit("gather_elements", [ins[0], idx], vals, {"axis": ax})


_RNN_CELLS = {"LSTM": ("lstm", ["sigmoid", "tanh", "tanh"]), "GRU": ("gru", ["sigmoid", "tanh"]),
              "RNN": ("rnn", ["tanh"])}  # fmt: skip


def _recurrent(ctx: _Ctx, ins, outs, a):
    """LSTM, GRU and RNN: one ``rnn`` node a direction (emitting the final cell state
    after the steps where Y_c is read), then moves to ONNX's Y [S, D, B, H], Y_h and
    Y_c [D, B, H] (``layout`` 1: batch first)."""
    op = ctx.node.op_type
    cell, acts = _RNN_CELLS[op]
    ins = ins + [""] * (8 - len(ins))
    x, layout = ins[0], int(a.get("layout", 0))
    got_acts = [_decode(v).lower() for v in a.get("activations", [])]
    dirs_n = 2 if _decode(a.get("direction", "forward")) == "bidirectional" else 1
    if got_acts and got_acts != acts * dirs_n:
        raise ctx.fail(f"activations {got_acts}; supported: the defaults {acts}")
    if "clip" in a:
        raise ctx.fail("clip is not supported")
    if int(a.get("input_forget", 0)):
        raise ctx.fail("input_forget=1 is not supported")
    if ins[7] and np.any(ctx.const(ins[7], "P (peepholes)")):
        raise ctx.fail("peepholes (P) are not supported")
    if layout:
        x = ctx.emit("transpose", [x], ctx.fresh(x + ".sbi"), {"perm": [1, 0, 2]})
    steps, batch, _ = ctx.shape(x)
    if ins[4]:
        lens = np.asarray(ctx.const(ins[4], "sequence_lens")).reshape(-1)
        if not np.all(lens == steps):
            raise ctx.fail(f"sequence_lens {lens.tolist()} shorter than the {steps} steps")
    hid = int(a.get("hidden_size", ctx.shape(ins[2])[-1]))
    g = ctx.shape(ins[1])[1]
    bias = ins[3] or ctx.add_const(
        ctx.fresh(ctx.node_name + ".b"), np.zeros((dirs_n, 2 * g), np.float32)
    )
    direction = _decode(a.get("direction", "forward"))

    def per_dir(name: str, d: int, ax: int = 0) -> str:
        """Direction d's part of ``name``: of W, R, B ([D, ...]) or an initial state
        ([D, B, H]; layout 1 [B, D, H], ``ax`` 1), a constant or a slice at run time."""
        if not name:
            return ""
        if name in ctx.g.consts:
            v = np.take(ctx.g.consts[name].astype(np.float32), d, axis=ax)
            return ctx.add_const(ctx.fresh(f"{name}.{d}"), v)
        xs = ctx.shape(name)
        part = ctx.emit(
            "slice", [name], ctx.fresh(f"{name}.{d}"), _slice_attrs(xs, {ax: (d, d + 1, 1)})
        )
        rest = [n for i, n in enumerate(xs) if i != ax]
        return ctx.emit("reshape", [part], ctx.fresh(f"{name}.{d}.part"), {"shape": rest})

    def last(seq: str, reverse: bool) -> str:
        t = 0 if reverse else steps - 1
        return ctx.emit("slice", [seq], ctx.fresh(seq + ".last"),
                        _slice_attrs((steps, batch, hid), {0: (t, t + 1, 1)}))  # fmt: skip

    ys, hs, cs = [], [], []
    for d in range(dirs_n):
        reverse = direction == "reverse" or d == 1
        lbr = int(a.get("linear_before_reset", 0))
        attrs = {"cell": cell, "reverse": int(reverse), "linear_before_reset": lbr, "emit": "h"}
        weights = [per_dir(t, d) for t in (ins[1], ins[2], bias)]
        states = [per_dir(t, d, layout) for t in (ins[5], ins[6] if cell == "lstm" else "")]
        rnn_ins = [x, *weights, *states][: 7 if cell == "lstm" else 6]
        want_c = cell == "lstm" and len(outs) > 2 and bool(outs[2])
        if want_c:  # one pass: the steps' h, then the final cell state as row `steps`
            yc = ctx.emit("rnn", rnn_ins, ctx.fresh(f"{ctx.node_name}.yc{d}"),
                          {**attrs, "emit": "hc"})  # fmt: skip
            rows = (steps + 1, batch, hid)
            cs.append(ctx.emit("slice", [yc], ctx.fresh(yc + ".c"),
                               _slice_attrs(rows, {0: (steps, steps + 1, 1)})))  # fmt: skip
            y = ctx.emit("slice", [yc], ctx.fresh(yc + ".h"),
                         _slice_attrs(rows, {0: (0, steps, 1)})) if outs[0] else yc  # fmt: skip
        else:
            y = ctx.emit("rnn", rnn_ins, ctx.fresh(f"{ctx.node_name}.y{d}"), attrs)
        ys.append(y)
        hs.append(last(y, reverse))

    def join(parts: list[str], out: str, shape: list[int], axis: int, perm: list[int] | None):
        parts = [ctx.emit("reshape", [p], ctx.fresh(p + ".d"), {"shape": shape}) for p in parts]
        whole = (
            parts[0]
            if len(parts) == 1
            else ctx.emit("concat", parts, ctx.fresh(out + ".cat"), {"axis": axis})
        )
        if perm:
            return ctx.emit("transpose", [whole], out, {"perm": perm})
        _reshape_to(ctx, whole, out, ctx.shape(whole))

    if outs[0]:
        join(ys, outs[0], [steps, 1, batch, hid], 1, [2, 0, 1, 3] if layout else None)
    for out, parts in (
        (outs[1] if len(outs) > 1 else "", hs),
        (outs[2] if len(outs) > 2 else "", cs),
    ):
        if out:
            join(parts, out, [1, batch, hid], 0, [1, 0, 2] if layout else None)


def _cumsum(ctx: _Ctx, ins, outs, a):
    ax = int(np.asarray(ctx.const(ins[1], "axis")).reshape(-1)[0])
    ax = _axis_of(ctx, ins[0], {"axis": ax})
    attrs = {
        "axis": ax,
        "exclusive": int(a.get("exclusive", 0)),
        "reverse": int(a.get("reverse", 0)),
    }
    ctx.emit("cumsum", [ins[0]], outs[0], attrs)


def _trilu(ctx: _Ctx, ins, outs, a):
    """Trilu: ``where`` over a mask of the last two axes (j - i >= k for the upper
    triangle, <= k for the lower; folded when k is a constant), zeros of x's dtype
    elsewhere."""
    x, xs = ins[0], ctx.shape(ins[0])
    if len(xs) < 2:
        raise ctx.fail(f"input of rank {len(xs)}; Trilu needs 2 or more")
    f = ctx.fresh
    k = ins[1] if len(ins) > 1 and ins[1] else ctx.add_const(f(ctx.node_name + ".k"), np.int64(0))
    if k not in ctx.g.consts and ctx.g.dtype(k) != "i64":
        k = ctx.emit("cast", [k], f(k + ".i64"), {"to": "i64"})
    elif k in ctx.g.consts:
        ctx.g.consts[k] = ctx.g.consts[k].astype(np.int64).reshape(())
    else:
        k = ctx.emit("reshape", [k], f(k + ".scalar"), {"shape": []})
    j_minus_i = np.arange(xs[-1])[None, :] - np.arange(xs[-2])[:, None]
    ramp = ctx.add_const(f(ctx.node_name + ".j_minus_i"), j_minus_i.astype(np.int64))
    kind = "greater_equal" if int(a.get("upper", 1)) else "less_equal"
    mask = ctx.emit("compare", [ramp, k], f(outs[0] + ".mask"), {"kind": kind})
    zero_dt = ctx.g.consts[x].dtype if x in ctx.g.consts else TENSOR_DTYPES[ctx.g.dtype(x)]
    z = ctx.add_const(f(ctx.node_name + ".zero"), np.zeros((), zero_dt))
    ctx.emit("where", [mask, x, z], outs[0], {})


def _one_hot(ctx: _Ctx, ins, outs, a):
    """OneHot: the indices (negative ones count from the end) compared with a ramp of
    ``depth`` along the new axis, then ``where`` between the off and on values."""
    idx = ins[0]
    depth = int(np.asarray(ctx.const(ins[1], "depth")).reshape(-1)[0])
    values = np.asarray(ctx.const(ins[2], "values")).reshape(-1)
    xs = ctx.shape(idx)
    ax = int(a.get("axis", -1))
    ax = ax + len(xs) + 1 if ax < 0 else ax
    if not 0 <= ax <= len(xs):
        raise ctx.fail(f"axis {a.get('axis')} out of range for indices of rank {len(xs)}")
    f = ctx.fresh
    if ctx.g.dtype(idx) != "i64":
        idx = ctx.emit("cast", [idx], f(idx + ".i64"), {"to": "i64"})
    zero = ctx.add_const(f(ctx.node_name + ".0"), np.zeros((), np.int64))
    neg = ctx.emit("compare", [idx, zero], f(idx + ".neg"), {"kind": "less"})
    dep = ctx.add_const(f(ctx.node_name + ".depth"), np.int64(depth))
    wrapped = ctx.emit("binary", [idx, dep], f(idx + ".wrapped"), {"kind": "add", **_NO_ACT})
    idx = ctx.emit("where", [neg, wrapped, idx], f(idx + ".pos"), {})
    idx = ctx.emit("reshape", [idx], f(idx + ".axis"), {"shape": [*xs[:ax], 1, *xs[ax:]]})
    ramp_shape = [1] * (len(xs) + 1)
    ramp_shape[ax] = depth
    ramp = ctx.add_const(
        f(ctx.node_name + ".ramp"), np.arange(depth, dtype=np.int64).reshape(ramp_shape)
    )
    hot = ctx.emit("compare", [idx, ramp], f(outs[0] + ".hot"), {"kind": "equal"})
    off = ctx.add_const(f(ctx.node_name + ".off"), values[0].reshape(()))
    on = ctx.add_const(f(ctx.node_name + ".on"), values[1].reshape(()))
    ctx.emit("where", [hot, on, off], outs[0], {})


def _mod(ctx: _Ctx, ins, outs, a):
    kind = "fmod" if int(a.get("fmod", 0)) else "mod"
    ctx.emit("binary", ins[:2], outs[0], {"kind": kind, **_NO_ACT})


def _expand(ctx: _Ctx, ins, outs, a):
    """Expand (bidirectional broadcasting) of a run-time tensor of any dtype."""
    xs = ctx.shape(ins[0])
    target = [int(d) for d in ctx.const(ins[1], "shape")]
    try:
        out = np.broadcast_shapes(xs, tuple(target))
    except ValueError:
        raise ctx.fail(f"shape {target} does not broadcast with {list(xs)}") from None
    if tuple(out) == tuple(xs):
        return _identity(ctx, ins, outs, a)
    ctx.emit("expand", [ins[0]], outs[0], {"shape": [int(d) for d in out]})


def _pad(ctx: _Ctx, ins, outs, a):
    xs = ctx.shape(ins[0])
    mode = _decode(a.get("mode", "constant"))
    if mode not in ("constant", "reflect", "edge"):
        raise ctx.fail(f"mode={mode!r}; supported: constant, reflect, edge")
    pads = [int(v) for v in ctx.const(ins[1], "pads")]
    value = ctx.opt_const(ins, 2)
    axes = ctx.opt_const(ins, 3)
    r = len(xs)
    if axes is not None:
        full = [0] * (2 * r)
        ax = [int(v) % r for v in axes]
        for j, axn in enumerate(ax):
            full[axn], full[axn + r] = pads[j], pads[j + len(ax)]
        pads = full
    if min(pads) < 0:
        raise ctx.fail(f"negative pads {pads} are not supported")
    ctx.emit(
        "pad",
        [ins[0]],
        outs[0],
        {
            "pads": pads,
            "mode": mode,
            "value": float(value.reshape(-1)[0]) if value is not None and value.size else 0.0,
        },
    )


def _dropout(ctx: _Ctx, ins, outs, a):
    """Dropout at inference: the identity, and its mask (if asked for) all true.
    training_mode true with a ratio above 0 draws random masks: refused."""
    train = ctx.opt_const(ins, 2)
    ratio = ctx.opt_const(ins, 1)
    if train is not None and bool(np.asarray(train).reshape(-1)[0]):
        if ratio is None or float(np.asarray(ratio).reshape(-1)[0]) > 0:
            raise ctx.fail("training_mode=true draws random masks; export in eval mode")
    _identity(ctx, ins[:1], outs[:1], a)
    if len(outs) > 1 and outs[1]:
        ctx.add_const(outs[1], np.ones(ctx.shape(ins[0]), bool))


Handler = Callable[[_Ctx, list, list, dict], None]
HANDLERS: dict[str, Handler] = {
    "Conv": _as_2d(_conv, weighted=True),
    "ConvTranspose": _as_2d(_conv_transpose, weighted=True),
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Add": _binary("add"),
    "Sub": _binary("sub"),
    "Mul": _binary("mul"),
    "Div": _binary("div"),
    "Max": _variadic("max"),
    "Min": _variadic("min"),
    "Sum": _variadic("add"),
    "Mean": _variadic("add", mean=True),
    "Relu": _act_node("relu"),
    "LeakyRelu": _act_node("leaky_relu"),
    "Clip": _act_node("clip"),
    "Sigmoid": _act_node("sigmoid"),
    "Tanh": _act_node("tanh"),
    "HardSigmoid": _act_node("hard_sigmoid"),
    "HardSwish": _act_node("hard_swish"),
    "Softmax": _softmax(False),
    "LogSoftmax": _softmax(True),
    "MaxPool": _as_2d(_pool("max"), weighted=False),
    "AveragePool": _as_2d(_pool("avg"), weighted=False),
    "LpPool": _pool("lp"),
    "GlobalAveragePool": _global_avg,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Concat": _concat,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "ReduceMean": _reduce_mean,
    **dict.fromkeys(REDUCE_OPS, _reduce),
    "GlobalMaxPool": _global_max,
    "Expand": _expand,
    "Cast": _cast,
    "CastLike": _cast_like,
    "Equal": _compare("equal"),
    "Less": _compare("less"),
    "LessOrEqual": _compare("less_equal"),
    "Greater": _compare("greater"),
    "GreaterOrEqual": _compare("greater_equal"),
    "And": _logic("and"),
    "Or": _logic("or"),
    "Xor": _logic("xor"),
    "Not": _logic("not"),
    "Where": _where,
    "IsNaN": _isnan,
    "Hardmax": _hardmax,
    "Attention": _attention,
    "LpNormalization": _lp_norm,
    "DepthToSpace": _depth_space(True),
    "SpaceToDepth": _depth_space(False),
    "IsInf": _isinf,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "ScatterElements": _scatter_elements,
    "Scatter": _scatter_elements,  # opset 9-10's name (axis 0 by default, no reduction)
    "ScatterND": _scatter_nd,
    "GatherND": _gather_nd,
    "GridSample": _grid_sample,
    "TopK": _topk,
    "Mod": _mod,
    "CumSum": _cumsum,
    "Trilu": _trilu,
    "OneHot": _one_hot,
    **dict.fromkeys(_RNN_CELLS, _recurrent),
    "Slice": _slice,
    "ArgMax": _argmax(False),
    "ArgMin": _argmax(True),
    "Split": _split,
    "Resize": _resize,
    "Pad": _pad,
    "Identity": _identity,
    "Dropout": _dropout,
    **dict.fromkeys(MATH_OPS, _math),
}
HANDLERS.update(NORM_HANDLERS)
HANDLERS.update(COMPOSITE_HANDLERS)
HANDLERS.update(quantized_handlers(HANDLERS))


# --- pack-time constant evaluation (shape arithmetic and friends) -----------------------


def _fold_numpy(ctx: _Ctx, op: str, vals: list, a: dict):
    """NumPy evaluation, dtype-preserving, for ops whose inputs are all constants."""
    v = vals
    if op == "Shape":
        start, end = a.get("start", 0), a.get("end", None)
        return np.array(v[0].shape[start:end], np.int64)
    if op in ("Add", "Sub", "Mul"):
        return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](v[0], v[1])
    if op == "Div":
        if v[0].dtype.kind in "iu":
            return (np.trunc(v[0] / v[1])).astype(v[0].dtype)
        return v[0] / v[1]
    if op == "Gather":
        return np.take(v[0], v[1].astype(np.int64), axis=int(a.get("axis", 0)))
    if op == "Cast":
        to = helper.tensor_dtype_to_np_dtype(int(a["to"]))
        return v[0].astype(to)
    if op == "Concat":
        return np.concatenate(v, axis=int(a["axis"]))
    if op == "Unsqueeze":
        axes = v[1] if len(v) > 1 else a["axes"]
        out = v[0]
        r = out.ndim + len(np.asarray(axes).reshape(-1))
        for ax in sorted(int(x) % r for x in np.asarray(axes).reshape(-1)):
            out = np.expand_dims(out, ax)
        return out
    if op == "Squeeze":
        axes = v[1] if len(v) > 1 else a.get("axes")
        return np.squeeze(v[0], axis=None if axes is None else tuple(int(x) for x in axes))
    if op == "Slice":
        data, starts, ends = v[0], v[1], v[2]
        axes = v[3] if len(v) > 3 and v[3] is not None else range(len(starts))
        steps = v[4] if len(v) > 4 and v[4] is not None else [1] * len(starts)
        idx = [slice(None)] * data.ndim
        for s, e, ax, st in zip(starts, ends, axes, steps):
            idx[int(ax)] = slice(int(s), int(e), int(st))
        return data[tuple(idx)]
    if op == "ConstantOfShape":
        val = numpy_helper.to_array(a["value"]) if "value" in a else np.zeros(1, np.float32)
        return np.full(tuple(int(x) for x in v[0]), val.reshape(-1)[0], val.dtype)
    if op == "Reshape":
        shape = [int(x) for x in v[1]]
        shape = [v[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return v[0].reshape(shape)
    if op == "Range":
        return np.arange(v[0], v[1], v[2]).astype(v[0].dtype)
    if op == "Equal":
        return np.equal(v[0], v[1])
    if op == "Where":
        return np.where(v[0], v[1], v[2])
    if op in ("Identity", "Dropout"):
        return v[0]
    if op == "Expand":  # bidirectional broadcasting, as ONNX defines it
        return np.broadcast_to(v[0], np.broadcast_shapes(v[0].shape, tuple(int(d) for d in v[1])))
    if op == "Tile":
        return np.tile(v[0], [int(r) for r in v[1]])
    if op == "GatherElements":
        ax = int(a.get("axis", 0))
        idx = v[1].astype(np.int64)
        return np.take_along_axis(v[0], np.where(idx < 0, idx + v[0].shape[ax], idx), axis=ax)
    if op == "IsNaN":
        return np.isnan(v[0])
    return None


FOLD_ONLY = {"Shape", "ConstantOfShape", "Range"}


def _constant(ctx: _Ctx, node: onnx.NodeProto, a: dict) -> np.ndarray:
    if "value" in a:
        return numpy_helper.to_array(a["value"])
    for key, dt in (
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
    ):
        if key in a:
            return np.array(a[key], dt)
    raise ctx.fail(f"attributes {sorted(a)}; supported: value, value_float(s), value_int(s)")


_DATA_SHAPED = ("its output's shape depends on the input's values, and edgepack plans every "
                "shape at pack time")  # fmt: skip
_SUBGRAPH = ("control flow (a subgraph) is not supported; export the model with it unrolled "
             "or folded (torch.onnx traces loops out)")  # fmt: skip
# ops refused by design, each with its reason (what a user can do instead)
REFUSED: dict[str, str] = {
    "NonZero": _DATA_SHAPED + " (a Where over a mask keeps a fixed shape)",
    "NonMaxSuppression": _DATA_SHAPED + " (export a fixed-size head, e.g. YOLO's NMS-free one "
                         "or TopK over the scores, and suppress after edgepack)",
    "Unique": _DATA_SHAPED,
    "Compress": _DATA_SHAPED + " (a Where over the condition keeps a fixed shape)",
    "If": _SUBGRAPH,
    "Loop": _SUBGRAPH,
    "Scan": _SUBGRAPH,
    "SequenceConstruct": "sequences are not supported (edgepack holds tensors)",
    "StringNormalizer": "string tensors are not supported (tokenize before the model)",
}  # fmt: skip


def supported_ops() -> list[str]:
    return sorted(set(HANDLERS) | {"Constant"} | FOLD_ONLY)


def parse_shape_overrides(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """``["name=1x3x224x224", ...]`` -> {name: shape}."""
    out = {}
    for s in specs or []:
        name, _, dims = s.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise PackError(f"bad --input-shape {s!r}; expected NAME=1x3x224x224") from None
        if not name or any(d <= 0 for d in out[name]):
            raise PackError(f"bad --input-shape {s!r}; expected NAME=1x3x224x224")
    return out


def parse_constant_inputs(specs: list[str] | None) -> dict[str, str]:
    """``["name=values.npy", "axes=0,2", ...]`` -> {name: spec}; the values are read
    against the input's declared type in import_onnx (resolve_constant_input)."""
    out = {}
    for s in specs or []:
        name, sep, value = s.partition("=")
        if not name or not sep or not value:
            raise PackError(f"bad --const-input {s!r}; expected NAME=FILE.npy or NAME=1,2,3")
        out[name] = value
    return out


def resolve_constant_input(name: str, spec, code: str, dims: list[int | None]) -> np.ndarray:
    """The value an input is fixed to at pack time (--const-input): an array, a .npy
    file, or comma-separated numbers, in the input's declared dtype and shape."""
    dtype = np.dtype(TENSOR_DTYPES[code])
    if isinstance(spec, np.ndarray):
        v = spec
    elif str(spec).endswith(".npy"):
        try:
            v = np.load(spec, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise PackError(f"--const-input {name}: cannot read {spec}: {e}") from None
    else:
        try:
            v = np.array([float(x) for x in str(spec).split(",")])
        except ValueError:
            raise PackError(
                f"--const-input {name}={spec}: expected a .npy file or numbers like 1,2,3"
            ) from None
        if len(dims) == 0 and v.size == 1:
            v = v.reshape(())
        elif None not in dims and int(np.prod(dims)) == v.size:
            v = v.reshape(dims)
    if v.dtype.kind not in "biuf" or (v.dtype.kind == "f" and dtype.kind in "biu"
                                      and not np.array_equal(v, np.round(v))):
        raise PackError(f"--const-input {name}: values of dtype {v.dtype} for a {code} input")
    if len(v.shape) != len(dims) or any(d is not None and d != s for d, s in zip(dims, v.shape)):
        raise PackError(
            f"--const-input {name}: values of shape {list(v.shape)} do not fit the "
            f"input's shape {[d or '?' for d in dims]}"
        )
    return np.ascontiguousarray(v.astype(dtype))


def import_onnx(
    model: onnx.ModelProto | str | Path,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    log: Callable[[str], None] = lambda s: None,
    constant_inputs: Mapping[str, np.ndarray | str] | None = None,
) -> Graph:
    """Import an ONNX model into edgepack IR with static shapes. ``constant_inputs``
    fixes inputs to values at pack time (--const-input): they become constants, so
    what they set (a Resize's scales, a Slice's starts, a Reshape's target) folds into
    the plan, and the bundle no longer takes them."""
    src_bytes = None
    if not isinstance(model, onnx.ModelProto):
        src_bytes = Path(model).read_bytes()
        model = onnx.load_model_from_string(src_bytes)
    else:
        src_bytes = model.SerializeToString()
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset < MIN_OPSET:
        # Older exporters (e.g. Paddle's opset 11) are common; ONNX's own converter
        # rewrites them to opset 13 semantics (Squeeze axes as inputs, ...). Below
        # opset 7 it succeeds for the ops whose adapters it has, and says which not.
        from onnx import version_converter

        try:
            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:  # the converter raises bare RuntimeErrors
            raise PackError(
                f"model uses ONNX opset {opset} and could not be converted to {MIN_OPSET}: "
                f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}"
            ) from None
        log(f"converted from ONNX opset {opset} to {MIN_OPSET}")
        opset = MIN_OPSET
    if opset is None or not (MIN_OPSET <= opset <= MAX_OPSET):
        raise PackError(
            f"model uses ONNX opset {opset}; supported: up to {MAX_OPSET} (opsets below "
            f"{MIN_OPSET} are converted to {MIN_OPSET} with onnx's version converter)"
        )
    others = [o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx")]
    g0 = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g0.initializer}
    graph = Graph([], [], [o.name for o in g0.output], {}, dict(inits))
    graph.meta = {
        "opset": opset,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "source_sha256": hashlib.sha256(src_bytes).hexdigest(),
        "graph_name": g0.name,
    }
    overrides = dict(input_shapes or {})
    fixed = dict(constant_inputs or {})
    for inp in g0.input:
        if inp.name in inits:
            continue  # old-style models list initializers as inputs
        kind = inp.type.WhichOneof("value")
        if kind != "tensor_type":
            raise PackError(
                f"model input {inp.name!r} is of ONNX type {kind or 'unknown'}; edgepack "
                "takes tensors (no sequences, maps or optionals)"
            )
        tt = inp.type.tensor_type
        code = _tensor_code(tt.elem_type)
        if code is None:
            raise PackError(
                f"model input {inp.name!r} has ONNX element type "
                f"{onnx.TensorProto.DataType.Name(tt.elem_type)}; edgepack takes "
                f"{', '.join(sorted(TENSOR_DTYPES))} tensors"
            )
        if code != "f32":
            graph.dtypes[inp.name] = code
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value == 0 and inp.name not in fixed:
                raise PackError(
                    f"input {inp.name!r} has a dimension of size 0; edgepack plans "
                    "tensors with at least one element (an empty operand, such as a "
                    f"Reduce's axes, can be fixed with --const-input {inp.name}=...)"
                )
            dims.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None)
        if inp.name in fixed:
            v = resolve_constant_input(inp.name, fixed.pop(inp.name), code, dims)
            graph.dtypes.pop(inp.name, None)
            graph.consts[inp.name] = v
            graph.meta.setdefault("constant_inputs", {})[inp.name] = {
                "dtype": code, "shape": list(v.shape),
                "sha256": hashlib.sha256(v.tobytes()).hexdigest(),
            }  # fmt: skip
            log(f"input {inp.name!r} fixed at pack time to {code}{list(v.shape)} values")
            continue
        if inp.name in overrides:
            shape = overrides.pop(inp.name)
            if len(shape) != len(dims) or any(
                a is not None and a != b for a, b in zip(dims, shape)
            ):
                raise PackError(
                    f"--input-shape {inp.name}={'x'.join(map(str, shape))} does not "
                    f"fit the model's shape {[d or '?' for d in dims]}"
                )
        else:
            if any(d is None for d in dims[1:]):
                raise PackError(
                    f"input {inp.name!r} has dynamic dims {[d or '?' for d in dims]}; "
                    f"fix them with --input-shape {inp.name}=1x..."
                )
            if dims and dims[0] is None:
                log(
                    f"input {inp.name!r}: dynamic batch dimension fixed to 1 "
                    "(use --input-shape to choose another)"
                )
            shape = tuple(1 if d is None else d for d in dims)
        graph.inputs.append(inp.name)
        graph.shapes[inp.name] = tuple(shape)
    if fixed:
        raise PackError(
            f"--const-input names unknown inputs {sorted(fixed)}; model inputs: "
            f"{[i.name for i in g0.input if i.name not in inits]}"
        )
    if constant_inputs and not graph.inputs:
        raise PackError("every model input is fixed by --const-input; nothing to run")
    if overrides:
        raise PackError(
            f"--input-shape names unknown inputs {sorted(overrides)}; model inputs: {graph.inputs}"
        )

    ctx = _Ctx(graph, opset)
    for idx, node in enumerate(g0.node):
        ctx.node = node
        ctx.node_name = node.name or f"{node.op_type}_{idx}"
        if node.domain not in ("", "ai.onnx"):
            raise ctx.fail(f"custom domain {node.domain!r} is not supported")
        a = _attrs(node)
        ins, outs = list(node.input), list(node.output)
        for i in ins:
            if i and i not in graph.consts and i not in graph.shapes:
                raise ctx.fail(f"input {i!r} is produced by no earlier node")
        if node.op_type == "Constant":
            graph.consts[outs[0]] = _constant(ctx, node, a)
            continue
        if node.op_type == "Shape" and ins[0] in graph.shapes:
            graph.consts[outs[0]] = _fold_numpy(
                ctx, "Shape", [np.empty(graph.shapes[ins[0]], np.uint8)], a
            )
            continue
        if all((not i) or i in graph.consts for i in ins):
            vals = [graph.consts[i] if i else None for i in ins]
            folded = _fold_numpy(ctx, node.op_type, vals, a)
            if folded is not None:
                graph.consts[outs[0]] = np.asarray(folded)
                continue
        if node.op_type in FOLD_ONLY:
            raise ctx.fail(
                "supported only when all its inputs are known at pack time "
                "(with static shapes, shape arithmetic folds away)"
            )
        h = HANDLERS.get(node.op_type)
        if h is None and node.op_type in REFUSED:
            raise ctx.fail(REFUSED[node.op_type])
        if h is None:
            raise ctx.fail(
                f"unsupported op. Supported ops: {', '.join(supported_ops())}"
                + (f" (model also imports domains {others})" if others else "")
            )
        try:
            h(ctx, ins, outs, a)
        except PackError:
            raise
        except (KeyError, ValueError, IndexError, TypeError) as e:
            raise ctx.fail(f"cannot import ({type(e).__name__}: {e})") from None
    if not graph.inputs and all(o in graph.consts for o in graph.outputs):
        raise PackError("the model takes no inputs and its outputs are constants; nothing to run")
    for o in graph.outputs:
        if o in graph.consts:  # a constant output (EyeLike, a Shape): copied out per run
            v = graph.consts.pop(o)
            src = ctx.add_const(ctx.fresh(o + ".value"), v)
            graph.nodes.append(Node("expand", f"{o}/value", [src], [o], {"shape": list(v.shape)},
                                    [o]))  # fmt: skip
            graph.shapes[o] = tuple(v.shape)
            if v.dtype != np.float32:
                graph.dtypes[o] = TENSOR_CODES[v.dtype]
        if o not in graph.shapes:
            raise PackError(f"output {o!r} is produced by no node")
    graph.remove_dead()
    return graph
