"""Plain NumPy reference for every IR op (llm.c style: simple, obviously right).

Every backend kernel is validated against these. They are also what the packager
uses for constant folding. Signature: ``fn(inputs, attrs) -> ndarray``; ``inputs``
follows the op's input order from ``docs/bundle-format.md`` with ``None`` for an
absent optional input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from ...runtime.bundle_format import TENSOR_DTYPES
from .. import layout
from ..activations import apply_act_ref
from ..mathfns import math_ref
from ..mbconv import parts as mbconv_parts
from ..mbconv import q_project_attrs, qparts
from ..ops import args, role
from ..winograd import conv_float64
from ..wtypes import DEQUANTIZE, bf16_to_f32, channel_scaled, of_array
from .llm import LLM_REFERENCE

Array = np.ndarray
RefFn = Callable[[Sequence[Array | None], dict], Array]


def dequantize(w: Array, scale: Array | None) -> Array:
    """int8 per-output-channel (axis 0) or fp16 weights back to float32 (the table's
    references for the rows a numpy dtype identifies; see ``node_weights``)."""
    dt = np.dtype(w.dtype)
    wide = dt.kind == "f" and dt.itemsize >= 4  # float32, or float64 from the references
    return channel_scaled(w if wide else DEQUANTIZE[of_array(w)](w, None), scale)


def _i4_in_node_layout(w: Array, scale: Array | None, op: str, attrs: dict):
    wshape = attrs["wshape"]
    if attrs.get("interleave"):  # rows side by side for the cpu kernel: canonical again
        w, scale = layout.q4_deinterleave(np.asarray(w), np.asarray(scale))
    flat = DEQUANTIZE["i4"](w, scale)  # [N, Kp], canonical
    k = int(np.prod(wshape[1:], dtype=np.int64))
    out = np.zeros(layout.node_weight_shape(op, wshape, attrs), np.float32)
    rows, cols = layout.weight_offsets(op, wshape, attrs)
    out.reshape(-1)[rows[:, None] + cols[None, :]] = flat[:, :k]
    return out, None


# Weight types whose stored arrays the op references cannot read as they are: decoded
# here into float32 in the node's layout, consuming their scale input (int8's channel
# scale and fp16 are dequantized inside the op references, in OIHW).
_TO_NODE_WEIGHTS = {
    "bf16": lambda w, s, op, attrs: (bf16_to_f32(w), s),
    "i4": _i4_in_node_layout,
    # rows side by side for the cpu kernel (a linear with int8 activations, and the embed
    # reading the same table): canonical again, still int8
    "i8": lambda w, s, op, attrs: (
        layout.q8_deinterleave(np.asarray(w)) if attrs.get("interleave") else w, s
    ),
}


def node_weights(dt: str, inputs: Sequence[Array | None], op: str, attrs: dict) -> list:
    """``inputs`` of a weight op whose weight is of type ``dt``, with the weight in a form
    the reference reads (float32 for bf16 and int4; canonical int8 rows)."""
    io = args(op, inputs)
    out = list(io)
    if dt in _TO_NODE_WEIGHTS:
        w, s = role(op, "w"), role(op, "scale")
        out[w], out[s] = _TO_NODE_WEIGHTS[dt](io.w, io.scale, op, attrs)
    return out


def _act(y: Array, attrs: dict) -> Array:
    return apply_act_ref(y, attrs.get("act", "none"), tuple(attrs.get("act_args", (0.0, 0.0))))


def conv(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """inputs: x[N,C,H,W], w[Co,C/g,kh,kw], bias[Co]?, scale[Co]?, residual[N,Co,OH,OW]?"""
    io = args("conv", inputs)
    x, bias, residual = io.x, io.bias, io.residual
    w = dequantize(io.w, io.scale)
    sh, sw = attrs["strides"]
    pt, pl, pb, pr = attrs["pads"]
    dh, dw = attrs["dilations"]
    g = attrs["group"]
    n, c, h, wd = x.shape
    co, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    cog = co // g
    y = np.zeros((n, co, oh, ow), np.float64)
    for gi in range(g):
        xs = xp[:, gi * cg : (gi + 1) * cg].astype(np.float64)
        wg = w[gi * cog : (gi + 1) * cog].astype(np.float64)
        for i in range(kh):
            for j in range(kw):
                patch = xs[
                    :,
                    :,
                    i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                    j * dw : j * dw + sw * (ow - 1) + 1 : sw,
                ]
                y[:, gi * cog : (gi + 1) * cog] += np.einsum("nchw,oc->nohw", patch, wg[:, :, i, j])
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)
    if residual is not None:
        y += residual
    return _act(y.astype(np.float32), attrs)


def quantize_u8(x: Array, scale: float, zero: int) -> Array:
    """ONNX QuantizeLinear to uint8 (x / scale in float32, round half to even, + zero,
    saturated; NaN as the zero point), as float32 values."""
    q = np.rint(x.astype(np.float32) / np.float32(scale)) + np.float32(zero)
    return np.where(np.isnan(q), np.float32(zero), np.clip(q, 0, 255)).astype(np.float32)


def requantize_u8(y: Array, attrs: dict) -> Array:
    """An int8 op's float32 result as the u8 codes of its output (attrs ``y_scale``,
    ``y_zero``): ``rint(y * (1 / y_scale)) + y_zero`` in float32, saturated, NaN as the
    zero point. A multiply by the float32 reciprocal, not a division: the kernels write
    codes for every output element, and a division per element cost more than the
    stores it saves (kernels/cpu/qgemm.py vstore_out). Without ``y_scale``: y."""
    if "y_scale" not in attrs:
        return y
    inv, z = np.float32(1) / np.float32(attrs["y_scale"]), np.float32(attrs["y_zero"])
    q = np.rint(y.astype(np.float32) * inv) + z
    return np.where(np.isnan(q), z, np.clip(q, 0, 255)).astype(np.uint8)


def _codes(x: Array, attrs: dict) -> Array:
    """An int8 op's input as its codes minus the zero point (float64): u8 codes as
    they are (an int8 op wrote them), float32 quantized (``quantize_u8``)."""
    z = int(attrs["x_zero"])
    if x.dtype == np.uint8:
        return x.astype(np.float64) - z
    return quantize_u8(x, attrs["x_scale"], z).astype(np.float64) - z


def qconv(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """int8 x int8 conv (kernels/cpu/qgemm.py), channels-last: x[N, H, W, C] quantized
    to u8 (``quantize_u8`` with the node's ``x_scale``, ``x_zero``; u8 codes as they
    are), the integer conv of (q - zero) with the int8 weights (float64, exact), rounded
    once to float32, times ``scale`` (the input's scale times the weights' per channel),
    plus bias and residual in float32 in that order, then the activation, then the
    output's codes with ``y_scale`` (``requantize_u8``)."""
    io = args("qconv", inputs)
    (kh, kw), c, co = attrs["kernel"], int(attrs["in_channels"]), int(attrs["out_channels"])
    z = int(attrs["x_zero"])
    xi = _codes(io.x, attrs)
    hwio = layout.from_dot4_panels(io.w, kh, kw, c, co)
    expect_zw = -z * hwio.reshape(-1, co).astype(np.int64).sum(0)
    if not np.array_equal(io.zw[:co], expect_zw):
        raise ValueError("qconv: zw is not -x_zero times the weights' column sums")
    cf = {k: attrs[k] for k in ("strides", "pads", "dilations")} | {"group": 1}
    w = hwio.astype(np.float64).transpose(layout.OIHW_FROM_HWIO)
    acc = conv([xi.transpose(layout.TO_NCHW), w, None, None, None], cf)  # float32, once
    y = acc.transpose(layout.TO_NHWC) * io.scale.astype(np.float32)
    if io.bias is not None:
        y = y + io.bias.astype(np.float32)
    if io.residual is not None:
        y = y + io.residual
    return requantize_u8(_act(np.ascontiguousarray(y, dtype=np.float32), attrs), attrs)


def qdwconv(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Depthwise conv into u8 codes (kernels/cpu/qdw.py), channels-last: ``conv`` of
    x[N, H, W, C] float32 with the stored weights (float64 sums), rounded once to
    float32, times ``scale``, plus bias, the activation, then ``requantize_u8``."""
    io = args("qdwconv", inputs)
    w = np.asarray(io.w, np.float64)  # [kh, kw, 1, C]
    cf = {k: attrs[k] for k in ("strides", "pads", "dilations")} | {"group": w.shape[3]}
    acc = conv([np.asarray(io.x, np.float64).transpose(layout.TO_NCHW),
                w.transpose(layout.OIHW_FROM_HWIO), None, None, None], cf)  # fmt: skip
    y = acc.transpose(layout.TO_NHWC) * io.scale.astype(np.float32)
    if io.bias is not None:
        y = y + io.bias.astype(np.float32)
    return requantize_u8(_act(np.ascontiguousarray(y, dtype=np.float32), attrs), attrs)


def conv_wino(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """A 3x3 stride-1 conv whose weights the packager stored Winograd-transformed:
    inputs as ``conv`` with U[a*a, C, Co] for w (float32, or fp16 / bf16 decoded). The
    Winograd algorithm runs in float64 on U as stored (winograd.conv_float64), then
    scale, bias, residual and activation as ``conv``; tests/test_kernels.py checks that
    on float32 U this is the direct conv of the untransformed weights."""
    io = args("conv_wino", inputs)
    y = conv_float64(io.x, np.asarray(io.w, np.float64), int(attrs["tile"]), attrs["pads"])
    if io.scale is not None:
        y = y * io.scale.astype(np.float64).reshape(1, -1, 1, 1)
    if io.bias is not None:
        y += io.bias.reshape(1, -1, 1, 1)
    if io.residual is not None:
        y += io.residual
    return _act(y.astype(np.float32), attrs)


# Activation blocks a linear node's ``xq`` attribute may name (kernels/cpu/qdot.py).
XQ_BLOCKS = (32,)


def quantize_activations(x: Array, block: int) -> Array:
    """x [..., K] rounded as a linear node with ``xq = block`` computes with it: each
    block of ``block`` values along K to int8 codes q = rint(x / d), d = max|x| / 127
    (float32), then q * d (ggml's Q8_0)."""
    if block not in XQ_BLOCKS:
        raise ValueError(f"linear xq={block}: activation blocks of {XQ_BLOCKS} only")
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    kp = -(-k // block) * block
    flat = np.zeros((int(np.prod(x.shape[:-1], dtype=np.int64)), kp), np.float32)
    flat[:, :k] = x.reshape(-1, k)
    b = flat.reshape(flat.shape[0], kp // block, block)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    safe = np.where(d > 0, d, np.float32(1))
    q = np.where(d > 0, np.clip(np.rint(b / safe), -127, 127), 0).astype(np.float32)
    return (q * d).reshape(flat.shape)[:, :k].reshape(x.shape)


def linear(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """y = x @ w.T + bias. inputs: x[..., K], w[N, K], bias[N]?, scale[N]?; with attribute
    ``xq`` the products take x as ``quantize_activations`` rounds it."""
    io = args("linear", inputs)
    x, bias = io.x, io.bias
    if attrs.get("xq"):
        x = quantize_activations(x, int(attrs["xq"]))
    w = dequantize(layout.linear_weights(io.w, attrs), io.scale)
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if bias is not None:
        y = y + bias
    return _act(y.astype(np.float32), attrs)


def matmul(inputs: Sequence[Array | None], attrs: dict) -> Array:
    a, b = inputs[0], inputs[1]
    return _act(np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32), attrs)


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
           "max": np.maximum, "min": np.minimum, "pow": np.power}  # fmt: skip


# integer division as ONNX Runtime's Div and Mod: toward zero; the divisor's sign (mod)
# or the dividend's (fmod)
_INT_BINARY = {**_BINARY, "mod": np.mod, "fmod": np.fmod,
               "div": lambda a, b: (a - np.fmod(a, b)) // b, "bit_and": np.bitwise_and,
               "bit_or": np.bitwise_or, "bit_xor": np.bitwise_xor}  # fmt: skip


def binary(inputs: Sequence[Array | None], attrs: dict) -> Array:
    a, b = inputs[0], inputs[1]
    if np.asarray(a).dtype.kind in "iu":  # integer tensors keep their dtype (ops.out_dtype)
        return _INT_BINARY[attrs["kind"]](a, b).astype(np.result_type(a, b))
    return _act(_BINARY[attrs["kind"]](a, b).astype(np.float32), attrs)


def unary(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return _act(inputs[0].astype(np.float32), attrs)


def math_op(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return math_ref(inputs[0], attrs["fn"], attrs.get("args", (0.0, 0.0)))


def softmax(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Softmax over ``axis``; with ``log`` the log-softmax, (x - max) - log(sum(exp))."""
    x = inputs[0].astype(np.float64)
    ax = attrs["axis"]
    z = x - x.max(axis=ax, keepdims=True)
    e = np.exp(z)
    if attrs.get("log"):
        return (z - np.log(e.sum(axis=ax, keepdims=True))).astype(np.float32)
    return (e / e.sum(axis=ax, keepdims=True)).astype(np.float32)


def sdpa(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """softmax(scale * q k^T + mask) v over the last two axes, in float64 (``k_t``: k
    given as K^T; ``nan_zero``: NaN probabilities as 0, torch's guard of fully masked
    rows)."""
    q, k, v, mask = (list(inputs) + [None] * 4)[:4]
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = attrs["scale"] * (q @ (k if attrs.get("k_t") else np.swapaxes(k, -1, -2)))
    if mask is not None:
        s = s + np.asarray(mask, np.float64)
    z = s - s.max(axis=-1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=-1, keepdims=True)
    if attrs.get("nan_zero"):
        p = np.where(np.isnan(p), 0.0, p)
    return (p @ v).astype(np.float32)


def _pool_windows(x: Array, attrs: dict, fill: float) -> tuple[Array, Array]:
    """Returns (windows[N,C,OH,OW,kh,kw], valid-mask of the same shape)."""
    kh, kw = attrs["kernel"]
    sh, sw = attrs["strides"]
    pt, pl, pb, pr = attrs["pads"]
    dh, dw = attrs.get("dilations", (1, 1))
    oh, ow = attrs["out_hw"]
    n, c, h, w = x.shape
    # Pad generously so ceil_mode windows that run past the explicit pads stay in range.
    extra_h = max(0, (oh - 1) * sh + dh * (kh - 1) + 1 - (h + pt + pb))
    extra_w = max(0, (ow - 1) * sw + dw * (kw - 1) + 1 - (w + pl + pr))
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb + extra_h), (pl, pr + extra_w)), constant_values=fill)
    inside = np.zeros(xp.shape[2:], np.int8)
    inside[pt : pt + h, pl : pl + w] = 2  # 2: real pixel
    inside[: h + pt + pb, : w + pl + pr] += 1  # +1: within the explicit pads
    win = np.empty((n, c, oh, ow, kh, kw), x.dtype)
    mask = np.empty((oh, ow, kh, kw), np.int8)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            win[..., i, j] = xp[:, :, rows, cols]
            mask[..., i, j] = inside[rows, cols]
    return win, mask


def maxpool(inputs: Sequence[Array | None], attrs: dict) -> Array:
    win, _ = _pool_windows(inputs[0], attrs, -np.inf)
    return win.max(axis=(4, 5)).astype(np.float32)


def avgpool(inputs: Sequence[Array | None], attrs: dict) -> Array:
    win, mask = _pool_windows(inputs[0].astype(np.float64), attrs, 0.0)
    # ONNX: count_include_pad counts explicit pads but never the ceil_mode overhang.
    counted = (mask >= 1) if attrs.get("count_include_pad", 0) else (mask >= 2)
    s = win.sum(axis=(4, 5))
    return (s / counted.sum(axis=(2, 3))).astype(np.float32)


def global_avgpool(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x = inputs[0]
    return x.astype(np.float64).mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(np.float32)


def channel_affine(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Unfolded BatchNormalization: y = x * scale[c] + shift[c] (channel axis 1)."""
    io = args("channel_affine", inputs)
    x, scale, shift = io.x, io.scale, io.shift
    shp = (1, -1) + (1,) * (x.ndim - 2)
    return _act((x * scale.reshape(shp) + shift.reshape(shp)).astype(np.float32), attrs)


def reshape(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return inputs[0].reshape(attrs["shape"])


def transpose(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return np.ascontiguousarray(np.transpose(inputs[0], attrs["perm"]))


def rows(inputs: Sequence[Array | None], attrs: dict) -> Array:
    start = int(attrs["start"])
    return np.ascontiguousarray(inputs[0][start : start + int(attrs["count"])])


def conv_transpose(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Each input pixel scatters x * w over a (dilated) kernel window at stride steps
    of an uncropped canvas; the canvas minus the begin pads (and past out_hw) is y."""
    io = args("conv_transpose", inputs)
    x, w, b = io.x.astype(np.float64), io.w.astype(np.float64), io.bias
    n, c, h, wd = x.shape
    g = int(attrs["group"])
    cig, cog, kh, kw = c // g, w.shape[1], w.shape[2], w.shape[3]
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl = attrs["pads"][0], attrs["pads"][1]
    oh, ow = attrs["out_hw"]
    ch = max(sh * (h - 1) + dh * (kh - 1) + 1, pt + oh)
    cw = max(sw * (wd - 1) + dw * (kw - 1) + 1, pl + ow)
    canvas = np.zeros((n, g * cog, ch, cw))
    for gi in range(g):
        xg = x[:, gi * cig : (gi + 1) * cig]
        wg = w[gi * cig : (gi + 1) * cig]
        for ky in range(kh):
            for kx in range(kw):
                contrib = np.einsum("nchw,co->nohw", xg, wg[:, :, ky, kx])
                ys, xs = ky * dh, kx * dw
                canvas[:, gi * cog : (gi + 1) * cog, ys : ys + sh * (h - 1) + 1 : sh,
                       xs : xs + sw * (wd - 1) + 1 : sw] += contrib  # fmt: skip
    y = canvas[:, :, pt : pt + oh, pl : pl + ow]
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y.astype(np.float32)


def resample(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Along ``axis``: output o is the sum over taps t of w[o, t] * x[idx[o, t]]
    (float64), the tables the packager made from a Resize's mode and coordinates."""
    x, idx, w = inputs[0].astype(np.float64), inputs[1], inputs[2].astype(np.float64)
    ax = int(attrs["axis"])
    taken = np.take(x, idx, axis=ax)  # [..., O, T, ...]
    shape = [1] * x.ndim + [1]
    shape[ax], shape[ax + 1] = w.shape
    return (taken * w.reshape(shape)).sum(axis=ax + 1).astype(np.float32)


def reduce(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """ONNX's Reduce* over ``axes`` in float64: sum, mean, max, min, prod, l1 (sum of
    |x|), l2 (its root of the sum of squares), sum_square, log_sum, log_sum_exp."""
    x, kind = inputs[0].astype(np.float64), attrs["kind"]
    ax, kd = tuple(attrs["axes"]), bool(attrs["keepdims"])
    with np.errstate(all="ignore"):
        if kind == "log_sum_exp":
            m = x.max(axis=ax, keepdims=True)
            y = np.log(np.exp(x - m).sum(axis=ax, keepdims=True)) + m
            y = y if kd else np.squeeze(y, ax)
        else:
            pre = {"l1": np.abs(x), "l2": x * x, "sum_square": x * x}.get(kind, x)
            fold = {"max": np.max, "min": np.min, "prod": np.prod, "mean": np.mean}
            y = fold.get(kind, np.sum)(pre, axis=ax, keepdims=kd)
            y = np.sqrt(y) if kind == "l2" else np.log(y) if kind == "log_sum" else y
    return np.asarray(y).astype(np.float32)


def cast(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """To the arena dtype ``to``: float to integer truncates toward zero, to bool is
    "not zero" (ONNX's Cast)."""
    with np.errstate(all="ignore"):
        return inputs[0].astype(TENSOR_DTYPES[attrs["to"]])


_COMPARE = {"equal": np.equal, "less": np.less, "less_equal": np.less_equal,
            "greater": np.greater, "greater_equal": np.greater_equal}  # fmt: skip
_LOGIC = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def compare(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return _COMPARE[attrs["kind"]](inputs[0], inputs[1])


def logic(inputs: Sequence[Array | None], attrs: dict) -> Array:
    if attrs["kind"] == "not":
        return np.logical_not(inputs[0])
    return _LOGIC[attrs["kind"]](inputs[0], inputs[1])


def where(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return np.where(inputs[0], inputs[1], inputs[2])


def take(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Gather along ``axis``: negative indices count from the end, others must lie in it."""
    x, idx, ax = inputs[0], np.asarray(inputs[1]), int(attrs["axis"])
    n = x.shape[ax]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"Gather: an index outside an axis of {n}")
    return np.take(x, np.where(idx < 0, idx + n, idx), axis=ax)


def _gs_reflect(v: float, lo: float, hi: float) -> float:
    rng = hi - lo
    if rng <= 0:
        return lo
    if lo <= v <= hi:
        return v
    d = lo - v if v < lo else v - hi
    k, r = divmod(d, rng)
    if v < lo:
        return lo + r if k % 2 == 0 else hi - r
    return hi - r if k % 2 == 0 else lo + r


def grid_sample(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """One output point at a time: its pixel coordinate per axis (from the grid's
    normalized one, listed innermost axis first), then the sum over the taps of each
    axis (nearest 1, linear 2, cubic 4 with Keys' a = -0.75) of their weights' product
    times the pixel, read by the padding rule."""
    x, grid = np.asarray(inputs[0], np.float64), np.asarray(inputs[1], np.float64)
    mode, pad, align = attrs["mode"], attrs["padding_mode"], bool(attrs["align_corners"])
    n, c, *dims = x.shape
    nd = len(dims)
    y = np.zeros((n, c, *grid.shape[1:-1]))

    def cubic(t: float) -> list[float]:
        a = -0.75
        near = lambda s: ((a + 2) * s - (a + 3)) * s * s + 1  # noqa: E731
        far = lambda s: ((a * s - 5 * a) * s + 8 * a) * s - 4 * a  # noqa: E731
        return [far(t + 1), near(t), near(1 - t), far(2 - t)]

    for b in range(n):
        for o in np.ndindex(*grid.shape[1:-1]):
            taps = []
            for i, d in enumerate(dims):
                g = float(np.float32(grid[(b, *o, nd - 1 - i)]))
                v = (g + 1) / 2 * (d - 1) if align else ((g + 1) * d - 1) / 2
                v = float(np.float32(v))
                if mode == "nearest":
                    v = float(np.rint(v))
                lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
                if (v < lo or v > hi) and pad == "border":
                    v = min(max(v, 0.0), d - 1.0)
                elif (v < lo or v > hi) and pad == "reflection":
                    v = _gs_reflect(v, lo, hi)
                if mode == "nearest":
                    axis = [(int(v), 1.0)]
                else:
                    f = math.floor(v)
                    t = v - f
                    ws = [1 - t, t] if mode == "linear" else cubic(t)
                    first = f - (1 if mode == "cubic" else 0)
                    axis = [(first + k, w) for k, w in enumerate(ws)]
                read = []
                for idx, w in axis:
                    if pad == "zeros" and not 0 <= idx < d:
                        idx = None
                    elif pad == "reflection":
                        idx = int(_gs_reflect(float(idx), lo, hi))
                    if idx is not None:
                        idx = min(max(idx, 0), d - 1)
                    read.append((idx, w))
                taps.append(read)
            for combo in itertools.product(*taps):
                w = float(np.prod([wk for _, wk in combo]))
                px = (np.zeros(c) if any(i is None for i, _ in combo)
                      else x[(b, slice(None), *[i for i, _ in combo])])  # fmt: skip
                y[(b, slice(None), *o)] += w * px
    return y.astype(np.float32)


def pool_nd(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """One window at a time: its taps inside x (max, the Lp norm, or the mean over the
    taps inside x, or inside x and its explicit pads with count_include_pad)."""
    x = np.asarray(inputs[0], np.float64)
    k, s, d, out = attrs["kernel"], attrs["strides"], attrs["dilations"], attrs["out"]
    nd, pads, kind = len(k), attrs["pads"], attrs["kind"]
    y = np.empty((*x.shape[:2], *out), np.float64)
    for o in np.ndindex(*out):
        taps = [[o[i] * s[i] + t * d[i] - pads[i] for t in range(k[i])] for i in range(nd)]
        inside = [[p for p in ts if 0 <= p < x.shape[2 + i]] for i, ts in enumerate(taps)]
        padded = [[p for p in ts if p < x.shape[2 + i] + pads[nd + i]] for i, ts in enumerate(taps)]
        win = x[(slice(None), slice(None), *np.ix_(*inside))] if all(inside) else None
        idx = (slice(None), slice(None), *o)
        if kind.startswith("argmax"):  # the first largest tap, as a flat index into x
            for b, ch in np.ndindex(*x.shape[:2]):
                best, at = -np.inf, -1
                for tap in itertools.product(*inside):
                    v = x[(b, ch, *tap)]
                    if v > best or at < 0:
                        sp = np.ravel_multi_index(tap, x.shape[2:],
                                                  order="F" if kind == "argmax_col" else "C")
                        best, at = v, int((b * x.shape[1] + ch) * np.prod(x.shape[2:]) + sp)
                y[(b, ch, *o)] = at
            continue
        if kind == "max":
            y[idx] = win.max(axis=tuple(range(2, 2 + nd))) if win is not None else -np.inf
        elif kind == "lp":
            p = attrs["p"]
            y[idx] = (np.abs(win) ** p).sum(axis=tuple(range(2, 2 + nd))) ** (1.0 / p)
        else:
            n = np.prod([len(t) for t in (padded if attrs["count_include_pad"] else inside)])
            y[idx] = win.sum(axis=tuple(range(2, 2 + nd))) / n
    return y.astype(np.int64 if kind.startswith("argmax") else np.float32)


_SCATTER_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _in_range(idx: np.ndarray, n, what: str) -> np.ndarray:
    """idx with negative entries counted from the end (n: one size, or one per last
    axis); an index outside is an error."""
    if idx.size and (np.any(idx < -np.asarray(n)) or np.any(idx >= np.asarray(n))):
        raise IndexError(f"{what}: an index outside an axis")
    return np.where(idx < 0, idx + n, idx)


def _scatter_into(y: np.ndarray, where: tuple, value, reduction: str) -> None:
    if reduction == "none":
        y[where] = value
    else:
        y[where] = _SCATTER_UFUNC[reduction](y[where], value)


def scatter_elements(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """One element at a time, in index order (repeated indices: the last one wins, or
    each combines in turn with ``reduction``)."""
    x, upd = inputs[0], inputs[2]
    ax = int(attrs["axis"])
    idx = _in_range(np.asarray(inputs[1]).astype(np.int64), x.shape[ax], "ScatterElements")
    y = np.array(x, copy=True)
    for pos in np.ndindex(*idx.shape):
        dst = list(pos)
        dst[ax] = idx[pos]
        _scatter_into(y, tuple(dst), upd[pos], attrs["reduction"])
    return y


def _nd_rows(x_shape, idx: np.ndarray, b: int, what: str) -> tuple[np.ndarray, int]:
    k = idx.shape[-1]
    return _in_range(idx.astype(np.int64), np.asarray(x_shape[b : b + k]), what), k


def gather_nd(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x, b = inputs[0], int(attrs["batch_dims"])
    idx, k = _nd_rows(x.shape, np.asarray(inputs[1]), b, "GatherND")
    out = np.empty((*idx.shape[:-1], *x.shape[b + k :]), x.dtype)
    for pos in np.ndindex(*idx.shape[:-1]):
        out[pos] = x[(*pos[:b], *idx[pos])]
    return out


def scatter_nd(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x, upd = inputs[0], inputs[2]
    idx, _ = _nd_rows(x.shape, np.asarray(inputs[1]), 0, "ScatterND")
    y = np.array(x, copy=True)
    for pos in np.ndindex(*idx.shape[:-1]):
        _scatter_into(y, tuple(idx[pos]), upd[pos], attrs["reduction"])
    return y


def gather_elements(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x, idx, ax = inputs[0], np.asarray(inputs[1]).astype(np.int64), int(attrs["axis"])
    n = x.shape[ax]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"GatherElements: an index outside an axis of {n}")
    # indices may be shorter than x off the axis: the leading part of x is read
    x = x[tuple(slice(None) if i == ax else slice(0, d) for i, d in enumerate(idx.shape))]
    return np.take_along_axis(x, np.where(idx < 0, idx + n, idx), axis=ax)


def topk(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """int64 indices of the ``k`` largest (``largest`` 0: smallest) along ``axis``, in
    order, the lower index first among equal values; NaN sorts after every number."""
    x, ax, k = np.asarray(inputs[0]), int(attrs["axis"]), int(attrs["k"])
    if attrs["largest"]:  # order-reversing, exact: -x for floats, ~x (-x - 1) for integers
        x = np.negative(x) if x.dtype.kind == "f" else np.invert(x)
    order = np.argsort(x, axis=ax, kind="stable")
    return np.take(order, np.arange(k), axis=ax).astype(np.int64)


def rnn(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """One direction of ONNX's LSTM (gates i o f c), GRU (z r h) and RNN, as ONNX's
    operator text writes them, step by step in float64. ``emit``: each step's h ("h"),
    its cell state ("c"), or h then a last row with the final cell state ("hc")."""
    x, w, r, b, h0, c0 = (list(inputs) + [None] * 6)[:6]
    x, w, r, b = (np.asarray(a, np.float64) for a in (x, w, r, b))
    cell, steps, batch = attrs["cell"], x.shape[0], x.shape[1]
    hid = r.shape[1]
    wb, rb = np.split(b, 2)
    h = np.zeros((batch, hid)) if h0 is None else np.asarray(h0, np.float64)
    c = np.zeros((batch, hid)) if c0 is None else np.asarray(c0, np.float64)
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    emit = attrs.get("emit", "h")
    out = np.empty((steps + (emit == "hc"), batch, hid))
    for t in (range(steps - 1, -1, -1) if attrs.get("reverse") else range(steps)):
        if cell == "rnn":
            h = np.tanh(x[t] @ w.T + wb + h @ r.T + rb)
        elif cell == "lstm":
            gi, go, gf, gc = np.split(x[t] @ w.T + wb + h @ r.T + rb, 4, axis=1)
            c = sig(gf) * c + sig(gi) * np.tanh(gc)
            h = sig(go) * np.tanh(c)
        else:
            (wz, wr, wh), (rz, rr, rh) = np.split(w, 3), np.split(r, 3)
            (bz, br, bh), (cz, cr, ch) = np.split(wb, 3), np.split(rb, 3)
            z = sig(x[t] @ wz.T + h @ rz.T + bz + cz)
            rg = sig(x[t] @ wr.T + h @ rr.T + br + cr)
            if attrs.get("linear_before_reset"):
                hh = np.tanh(x[t] @ wh.T + rg * (h @ rh.T + ch) + bh)
            else:
                hh = np.tanh(x[t] @ wh.T + (rg * h) @ rh.T + ch + bh)
            h = (1 - z) * hh + z * h
        out[t] = c if emit == "c" else h
    if emit == "hc":  # the final cell state after the steps' h
        out[steps] = c
    return out.astype(np.float32)


def cumsum(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x, ax = np.asarray(inputs[0]), int(attrs["axis"])
    acc = np.float64 if x.dtype.kind == "f" else x.dtype
    src = np.flip(x, ax) if attrs.get("reverse") else x
    out = np.cumsum(src.astype(acc), axis=ax)
    if attrs.get("exclusive"):
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=ax)),
                              np.take(out, range(x.shape[ax] - 1), axis=ax)], axis=ax)  # fmt: skip
    return (np.flip(out, ax) if attrs.get("reverse") else out).astype(x.dtype)


def expand(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return np.broadcast_to(inputs[0], tuple(attrs["shape"])).copy()


def argmax(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """int64 index of the largest (``min``: smallest) value along ``axis``; ties: the
    first, or the last with ``select_last``."""
    x, ax = inputs[0], int(attrs["axis"])
    f = np.argmin if attrs.get("min") else np.argmax
    if attrs.get("select_last"):
        idx = x.shape[ax] - 1 - f(np.flip(x, ax), axis=ax)
    else:
        idx = f(x, axis=ax)
    idx = idx.astype(np.int64)
    return np.expand_dims(idx, ax) if attrs["keepdims"] else idx


def slice_op(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """Elements starts + i * steps, i < sizes, on every axis (steps may be negative)."""
    spans = zip(attrs["starts"], attrs["steps"], attrs["sizes"])
    idx = [b + st * np.arange(n) for b, st, n in spans]
    return np.ascontiguousarray(inputs[0][np.ix_(*idx)]) if idx else inputs[0].copy()


def concat(inputs: Sequence[Array | None], attrs: dict) -> Array:
    return np.concatenate([i for i in inputs if i is not None], axis=attrs["axis"])


def reduce_mean(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x = inputs[0].astype(np.float64)
    return x.mean(axis=tuple(attrs["axes"]), keepdims=bool(attrs["keepdims"])).astype(np.float32)


def pad(inputs: Sequence[Array | None], attrs: dict) -> Array:
    x = inputs[0]
    p = attrs["pads"]  # ONNX order: begins for every axis, then ends
    r = x.ndim
    width = [(p[i], p[i + r]) for i in range(r)]
    mode = attrs.get("mode", "constant")
    if mode == "constant":
        return np.pad(x, width, mode="constant", constant_values=attrs.get("value", 0.0))
    return np.pad(x, width, mode={"reflect": "reflect", "edge": "edge"}[mode])


def _any_layout(op: str, fn: RefFn) -> RefFn:
    """``fn`` extended to channels-last nodes (kernels/layout.py): the channels-first
    reference on transposed activations and weights, its output transposed back."""

    def run(inputs: Sequence[Array | None], attrs: dict) -> Array:
        if not layout.is_nhwc(attrs):
            return fn(inputs, attrs)
        feed = list(inputs)
        for i in layout.activation_inputs(op, len(feed)):
            if feed[i] is not None:
                feed[i] = feed[i].transpose(layout.TO_NCHW)
        if op in layout.WEIGHT_IN_HWIO:
            w = role(op, "w")
            feed[w] = layout.hwio_weights(feed[w], attrs).transpose(layout.OIHW_FROM_HWIO)
        y = fn(feed, layout.channels_first_attrs(attrs))
        return np.ascontiguousarray(y.transpose(layout.TO_NHWC)) if layout.output_is_nhwc(op) else y

    return run


def mbconv(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """The fused pointwise -> depthwise -> pointwise chain (kernels/mbconv.py): the
    three convs one after the other, whole."""
    expand, dw, project = mbconv_parts(inputs)
    x = dw[0] if expand is None else REFERENCE["conv"](expand, attrs["expand"])
    d = REFERENCE["dwconv"]([x, *dw[1:]], attrs["dw"])
    return REFERENCE["conv"]([d, *project[1:]], attrs["project"])


def qmbconv(inputs: Sequence[Array | None], attrs: dict) -> Array:
    """The fused int8 chain (kernels/mbconv.py): ``qconv``, ``qdwconv``, ``qconv``,
    one after the other, whole."""
    expand, dw, project = qparts(inputs)
    e = qconv(expand, attrs["expand"])
    d = qdwconv([e, *dw[1:]], attrs["dw"])
    return qconv([d, *project[1:]], q_project_attrs(attrs))


REFERENCE: dict[str, RefFn] = {
    "conv": conv,
    "dwconv": conv,
    "qdwconv": qdwconv,
    "conv_wino": conv_wino,
    "qconv": qconv,
    "linear": linear,
    "matmul": matmul,
    "binary": binary,
    "unary": unary,
    "math": math_op,
    "softmax": softmax,
    "sdpa": sdpa,
    "maxpool": maxpool,
    "avgpool": avgpool,
    "global_avgpool": global_avgpool,
    "channel_affine": channel_affine,
    "reshape": reshape,
    "transpose": transpose,
    "concat": concat,
    "rows": rows,
    "slice": slice_op,
    "argmax": argmax,
    "reduce": reduce,
    "cast": cast,
    "compare": compare,
    "logic": logic,
    "where": where,
    "take": take,
    "gather_elements": gather_elements,
    "scatter_elements": scatter_elements,
    "pool_nd": pool_nd,
    "grid_sample": grid_sample,
    "gather_nd": gather_nd,
    "scatter_nd": scatter_nd,
    "topk": topk,
    "cumsum": cumsum,
    "rnn": rnn,
    "expand": expand,
    "resample": resample,
    "conv_transpose": conv_transpose,
    "reduce_mean": reduce_mean,
    "pad": pad,
    "mbconv": mbconv,
    "qmbconv": qmbconv,
    **LLM_REFERENCE,
}
for _op in layout.LAYOUT_OPS:
    REFERENCE[_op] = _any_layout(_op, REFERENCE[_op])
