"""The cuda backend: numba.cuda kernels plus cuBLAS (through cupy) for matrix products.

Bind functions receive device arrays (``xp`` arrays: cupy on a GPU, NumPy under the
numba CUDA simulator), already in the device arena; weights were uploaded once by the
executor's device (kernels/cuda/device.py). Binding wraps every argument for numba and
configures every launch, so a step is a few kernel calls and nothing else.

Design per op (the cpu backend's split of work, on channels-first nodes):

- conv: im2col kernel -> GEMM (``xp.matmul`` into the output slot) -> fused epilogue
  kernel (scale, bias, residual, activation). int8/fp16 weights are decoded into
  scratch by a kernel each run; the int8 scale is applied in the epilogue.
- dwconv: one direct kernel with the epilogue fused; int8 weights are read as they
  are, fp16 ones decoded into scratch first.
- linear: decode (int8/fp16) -> GEMM -> column epilogue kernel.
- matmul: GEMM (batched, broadcasting) -> activation kernel.
- pooling, softmax, means, elementwise, pad (all modes), transpose, concat: kernels.

Importing this module registers the kernels and imports neither numba.cuda nor cupy:
they load when a kernel is first bound (``_k()``, ``_d()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import generic as G
from .. import layout, ops, wtypes
from ..binding import act_args as _act
from ..binding import epilogue_flags as _flags
from ..binding import nbytes as _nbytes
from ..decoded import decoded
from ..mathfns import math_code
from ..ops import BINARY_KINDS, norm_group
from ..ops import args as _args
from ..recurrent import rnn_scratch_floats, rnn_step
from ..registry import Bound, Kernel, Spec, register

F32 = np.dtype(np.float32)
MAX_RANK = 6  # the strided kernels index 6-D views


def _k():
    from . import kernels as cuda_kernels

    return cuda_kernels


def _d():
    from .device import dev

    return dev()


def _f32_slot(scratch: Any, offset: int, shape: tuple[int, ...]) -> tuple[Any, int]:
    n = _nbytes(shape)
    return scratch[offset : offset + n].view(np.float32).reshape(shape), offset + n


class _Dummies:
    """Placeholders for absent optional inputs (kernels still need an array there)."""

    def __init__(self, d) -> None:
        xp = d.xp
        self.v1 = d.arg(xp.zeros(1, xp.float32))
        self.v3 = d.arg(xp.zeros((1, 1, 1), xp.float32))
        self.v4 = d.arg(xp.zeros((1, 1, 1, 1), xp.float32))


_DUMMIES: _Dummies | None = None


def _dummies(d) -> _Dummies:
    global _DUMMIES
    if _DUMMIES is None:
        _DUMMIES = _Dummies(d)
    return _DUMMIES


def _decoder(d, w: Any, dst: Any):
    """A step that widens device weights of a type their dtype names (int8, fp16, bf16)
    into the float32 scratch ``dst``, with the decoder the weight-type table names.
    Half formats decode as integers, bit-exact: no reliance on GPU fp16 units."""
    row = wtypes.get(wtypes.of_array(w))
    src, out = w.reshape(-1), dst.reshape(-1)
    kern = d.launch(getattr(_k(), row.decoders["cuda"]), src.size)
    if row.storage.itemsize == 2:
        src, out = src.view(np.uint16), out.view(np.uint32)
    a, b = d.arg(src), d.arg(out)
    return lambda: kern(a, b)


def _as6(a: Any) -> Any:
    """A view with leading unit axes up to 6-D (strides kept, so broadcasts survive)."""
    if a.ndim > MAX_RANK:
        raise NotImplementedError(f"cuda kernels take tensors of rank <= {MAX_RANK}")
    return a.reshape((1,) * (MAX_RANK - a.ndim) + a.shape) if a.ndim < MAX_RANK else a


def _view6(a: Any) -> Any:
    """Like ``_as6`` for strided views, which reshape may refuse: index with None."""
    if a.ndim > MAX_RANK:
        raise NotImplementedError(f"cuda kernels take tensors of rank <= {MAX_RANK}")
    return a[(None,) * (MAX_RANK - a.ndim)]


# --- conv ---------------------------------------------------------------------------


def _is_pointwise(wshape: Sequence[int], attrs: dict) -> bool:
    return (
        tuple(wshape[2:]) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["pads"])
    )


def _conv_scratch(ins: Sequence[Spec | None], outs: Sequence[tuple[int, ...]], attrs: dict) -> int:
    (wshape, wdt) = _args("conv", ins).w
    co, cg, kh, kw = wshape
    oh, ow = outs[0][2], outs[0][3]
    need = 0 if wdt == "f32" else _nbytes((co, cg * kh * kw))
    if not _is_pointwise(wshape, attrs):
        need += _nbytes((cg * kh * kw, oh * ow))
    return need


def _bind_conv(ins, outs, scratch, attrs) -> Bound:
    d, K = _d(), _k()
    io = _args("conv", ins)
    x, w, bias, scale, res = io.x, io.w, io.bias, io.scale, io.residual
    y = outs[0]
    n_, _, h, wd = x.shape
    co, cg, kh, kw = w.shape
    g = attrs["group"]
    cog, kk = co // g, cg * kh * kw
    oh, ow = y.shape[2], y.shape[3]
    p = oh * ow
    sh, sw = attrs["strides"]
    pt, pl, _, _ = attrs["pads"]
    dh, dw = attrs["dilations"]
    off = 0
    w2 = w.reshape(co, kk)
    decode = None
    if w.dtype != F32:
        wf, off = _f32_slot(scratch, off, (co, kk))
        decode = _decoder(d, w2, wf)
        w2 = wf
    pointwise = _is_pointwise(w.shape, attrs)
    cols = None if pointwise else _f32_slot(scratch, off, (kk, p))[0]
    col_kern = None if pointwise else d.launch(K.im2col, kk * p)
    gemms = []
    for n in range(n_):
        for gi in range(g):
            xg = x[n, gi * cg : (gi + 1) * cg]
            yg = y[n, gi * cog : (gi + 1) * cog].reshape(cog, p)
            wg = w2[gi * cog : (gi + 1) * cog]
            if pointwise:
                gemms.append((None, wg, xg.reshape(cg, h * wd), yg))
            else:
                gemms.append((d.arg(xg), wg, cols, yg))
    cols_arg = None if pointwise else d.arg(cols)
    dm = _dummies(d)
    y3 = d.arg(y.reshape(n_, co, p))
    r3 = d.arg(res.reshape(n_, co, p)) if res is not None else dm.v3
    b_ = d.arg(bias) if bias is not None else dm.v1
    s_ = d.arg(scale) if scale is not None else dm.v1
    flags = _flags(bias, scale, res)
    act, a, b = _act(attrs)
    epi = d.launch(K.epilogue_rows, n_ * co * p)
    matmul = d.matmul

    def step() -> None:
        if decode is not None:
            decode()
        for xa, wg, rhs, yg in gemms:
            if xa is not None:
                col_kern(xa, cols_arg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow)
            matmul(wg, rhs, yg)
        if flags or act:
            epi(y3, b_, s_, r3, flags, act, a, b)

    return step


# --- depthwise conv -------------------------------------------------------------------


# Weight types the depthwise kernel reads as they are; others are widened into scratch.
_DW_READS = ("f32", "i8")


def _dw_scratch(ins, outs, attrs) -> int:
    wshape, wdt = _args("dwconv", ins).w
    return 0 if wdt in _DW_READS else _nbytes(wshape)


def _bind_dwconv(ins, outs, scratch, attrs) -> Bound:
    d, K = _d(), _k()
    io = _args("dwconv", ins)
    x, w, bias, scale, res = io.x, io.w, io.bias, io.scale, io.residual
    y = outs[0]
    decode = None
    if wtypes.of_array(w) not in _DW_READS:
        wf = _f32_slot(scratch, 0, w.shape)[0]
        decode = _decoder(d, w, wf)
        w = wf
    sh, sw = attrs["strides"]
    pt, pl, _, _ = attrs["pads"]
    dh, dw = attrs["dilations"]
    dm = _dummies(d)
    args = (
        d.arg(x),
        d.arg(w),
        d.arg(bias) if bias is not None else dm.v1,
        d.arg(scale) if scale is not None else dm.v1,
        d.arg(res) if res is not None else dm.v4,
        d.arg(y),
    )
    rest = (sh, sw, pt, pl, dh, dw, _flags(bias, scale, res), *_act(attrs))
    kern = d.launch(K.dwconv, y.size)

    def step() -> None:
        if decode is not None:
            decode()
        kern(*args, *rest)

    return step


# --- linear ---------------------------------------------------------------------------


def _linear_scratch(ins, outs, attrs) -> int:
    wshape, wdt = _args("linear", ins).w
    return 0 if wdt == "f32" else _nbytes(wshape)  # the GEMM reads float32 weights


def _bind_linear(ins, outs, scratch, attrs) -> Bound:
    d, K = _d(), _k()
    io = _args("linear", ins)
    x, w, bias, scale = io.x, io.w, io.bias, io.scale
    y = outs[0]
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.reshape(-1, w.shape[0])
    decode = None
    if w.dtype != F32:
        wf = _f32_slot(scratch, 0, w.shape)[0]
        decode = _decoder(d, w, wf)
        w = wf
    wt = w.T  # cuBLAS takes the transpose as a flag: no copy
    dm = _dummies(d)
    flags = _flags(bias, scale, None)
    act, a, b = _act(attrs)
    epi = d.launch(K.epilogue_cols, y2.size)
    y_arg = d.arg(y2)
    b_ = d.arg(bias) if bias is not None else dm.v1
    s_ = d.arg(scale) if scale is not None else dm.v1
    matmul = d.matmul

    def step() -> None:
        if decode is not None:
            decode()
        matmul(x2, wt, y2)
        if flags or act:
            epi(y_arg, b_, s_, flags, act, a, b)

    return step


# --- matmul, elementwise ----------------------------------------------------------------


def _act_step(d, y: Any, attrs: dict):
    act, a, b = _act(attrs)
    if act == 0:
        return None
    yf = d.arg(y.reshape(-1))
    kern = d.launch(_k().act_into, y.size)
    return lambda: kern(yf, yf, act, a, b)


def _bind_matmul(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    a_, b_, y = ins[0], ins[1], outs[0]
    post = _act_step(d, y, attrs)
    matmul = d.matmul

    def step() -> None:
        matmul(a_, b_, y)
        if post is not None:
            post()

    return step


_KIND = {k: i for i, k in enumerate(BINARY_KINDS)}


def _bind_binary(ins, outs, scratch, attrs) -> Bound:
    d, K = _d(), _k()
    a_, b_, y = ins[0], ins[1], outs[0]
    if y.dtype != np.float32:  # integer tensors: the array module's ufunc
        return G.int_binary_step(d.xp, a_, b_, y, attrs["kind"])
    xp = d.xp
    y6 = _as6(y)
    args = (
        d.arg(xp.broadcast_to(_as6(a_), y6.shape)),
        d.arg(xp.broadcast_to(_as6(b_), y6.shape)),
        d.arg(y6),
        _KIND[attrs["kind"]],
        *_act(attrs),
    )
    kern = d.launch(K.binary6, y.size)
    return lambda: kern(*args)


def _bind_unary(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    xf, yf = d.arg(ins[0].reshape(-1)), d.arg(outs[0].reshape(-1))
    kern = d.launch(_k().act_into, outs[0].size)
    act, a, b = _act(attrs)
    return lambda: kern(xf, yf, act, a, b)


def _bind_math(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    xf, yf = d.arg(ins[0].reshape(-1)), d.arg(outs[0].reshape(-1))
    kern = d.launch(_k().math_into, outs[0].size)
    a, b = attrs.get("args", (0.0, 0.0))
    code = math_code(attrs["fn"])
    return lambda: kern(xf, yf, code, float(a), float(b))


def _bind_softmax(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    x, y = ins[0], outs[0]
    ax = attrs["axis"] % x.ndim
    outer = int(np.prod(x.shape[:ax]))
    inner = int(np.prod(x.shape[ax + 1 :]))
    shape3 = (outer, x.shape[ax], inner)
    x3, y3 = d.arg(x.reshape(shape3)), d.arg(y.reshape(shape3))
    kern, log = d.launch(_k().softmax3, outer * inner), bool(attrs.get("log"))
    return lambda: kern(x3, y3, log)


def _sdpa_scratch(ins, outs, attrs) -> int:
    """The scores, [..., Sq, Sk] float32."""
    q, v = ins[0][0], ins[2][0]
    return 4 * int(np.prod(q[:-1])) * v[-2]


def _bind_sdpa(ins, outs, scratch, attrs) -> Bound:
    """q k^T by cuBLAS into the scores, the scale and mask by the array module, the
    softmax kernel in place over the scores' rows, then scores @ v."""
    d = _d()
    xp = d.xp
    q, k, v, mask = (list(ins) + [None] * 4)[:4]
    y = outs[0]
    kt = k if attrs.get("k_t") else xp.swapaxes(k, -1, -2)
    sk, rows = v.shape[-2], int(np.prod(q.shape[:-1]))
    s = scratch.view("float32")[: rows * sk].reshape(*q.shape[:-1], sk)
    s3 = d.arg(s.reshape(rows, sk, 1))
    soft, scale = d.launch(_k().softmax3, rows), np.float32(attrs["scale"])
    nan_zero = bool(attrs.get("nan_zero"))

    def step() -> None:
        d.matmul(q, kt, s)
        xp.multiply(s, scale, out=s)
        if mask is not None:
            xp.add(s, mask, out=s)
        soft(s3, s3, False)
        if nan_zero:  # probabilities are never infinite: only NaN changes
            xp.nan_to_num(s, copy=False, nan=0.0)
        d.matmul(s, v, y)

    return step


def _bind_channel_affine(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    io = _args("channel_affine", ins)
    x, scale, shift, y = io.x, io.scale, io.shift, outs[0]
    n_, c_ = x.shape[0], x.shape[1]
    args = (
        d.arg(x.reshape(n_, c_, -1)),
        d.arg(scale),
        d.arg(shift),
        d.arg(y.reshape(n_, c_, -1)),
        *_act(attrs),
    )
    kern = d.launch(_k().channel_affine, y.size)
    return lambda: kern(*args)


# --- pooling ---------------------------------------------------------------------------


def _bind_pool(kind: str):
    def bind(ins, outs, scratch, attrs) -> Bound:
        d, K = _d(), _k()
        x, y = ins[0], outs[0]
        kh, kw = attrs["kernel"]
        sh, sw = attrs["strides"]
        pt, pl, pb, pr = attrs["pads"]
        xa, ya = d.arg(x), d.arg(y)
        if kind == "max":
            dh, dw = attrs.get("dilations", (1, 1))
            kern = d.launch(K.maxpool, y.size)
            return lambda: kern(xa, ya, kh, kw, sh, sw, pt, pl, dh, dw)
        inc = 1 if attrs.get("count_include_pad", 0) else 0
        kern = d.launch(K.avgpool, y.size)
        return lambda: kern(xa, ya, kh, kw, sh, sw, pt, pl, pb, pr, inc)

    return bind


def _bind_global_avgpool(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    x, y = ins[0], outs[0]
    rows = x.shape[0] * x.shape[1]
    x2, y1 = d.arg(x.reshape(rows, -1)), d.arg(y.reshape(rows))
    kern = d.launch(_k().global_avgpool, rows)
    return lambda: kern(x2, y1)


def _bind_reduce_mean(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    x, y = ins[0], outs[0]
    axes = sorted({a % x.ndim for a in attrs["axes"]})
    kept = [i for i in range(x.ndim) if i not in axes]
    xt = _view6(x.transpose(kept + axes))  # kept axes lead, in y's order
    xa, ya = d.arg(xt), d.arg(y.reshape(-1))
    kern = d.launch(_k().reduce_mean6, y.size)
    nred = len(axes)
    return lambda: kern(xa, ya, nred)


# --- data movement -----------------------------------------------------------------------


def _copy_step(d, src: Any, dst: Any):
    kern = d.launch(_k().copy6, dst.size)
    s, t = d.arg(_view6(src)), d.arg(_view6(dst))
    return lambda: kern(s, t)


def _shares(a: Any, b: Any) -> bool:
    # Both modes: same base pointer and size means the plan aliased them.
    if isinstance(a, np.ndarray):
        return bool(np.shares_memory(a, b))
    return a.data.ptr == b.data.ptr and a.nbytes == b.nbytes


def _bind_reshape(ins, outs, scratch, attrs) -> Bound:
    x, y = ins[0], outs[0]
    if _shares(x, y):
        return None
    d = _d()
    return _copy_step(d, x.reshape(y.shape), y)


def _bind_transpose(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    return _copy_step(d, ins[0].transpose(attrs["perm"]), outs[0])


def _bind_rows(ins, outs, scratch, attrs) -> Bound:
    start, y = int(attrs["start"]), outs[0]
    return _copy_step(_d(), ins[0][start : start + y.shape[0]], y)


def _bind_conv_transpose(ins, outs, scratch, attrs) -> Bound:
    d, io = _d(), _args("conv_transpose", ins)
    bias = d.arg(io.bias) if io.bias is not None else _dummies(d).v1
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    args = (d.arg(io.x), d.arg(io.w), bias, d.arg(outs[0]), int(sh), int(sw),
            int(attrs["pads"][0]), int(attrs["pads"][1]), int(dh), int(dw),
            int(attrs["group"]), io.bias is not None)  # fmt: skip
    kern = d.launch(_k().conv_transpose, outs[0].size)
    return lambda: kern(*args)


def _bind_resample(ins, outs, scratch, attrs) -> Bound:
    d, io, ax = _d(), _args("resample", ins), int(attrs["axis"])

    def as3(a):
        return a.reshape(int(np.prod(a.shape[:ax])), a.shape[ax], int(np.prod(a.shape[ax + 1 :])))

    args = (d.arg(as3(io.x)), d.arg(io.idx), d.arg(io.w), d.arg(as3(outs[0])))
    kern = d.launch(_k().resample3, outs[0].size)
    return lambda: kern(*args)


def _reduce_scratch(ins, outs, attrs) -> int:
    x, y = int(np.prod(ins[0][0])), int(np.prod(outs[0]))
    return 4 * G.reduce_scratch_floats(attrs["kind"], x, y)


def _bind_reduce(ins, outs, scratch, attrs) -> Bound:
    return G.reduce_step(_d().xp, ins[0], outs[0], scratch.view("float32"), attrs)


def _rnn_scratch(ins, outs, attrs) -> int:
    (steps, batch, _), _ = ins[0]
    hid = outs[0][2]
    return 4 * rnn_scratch_floats(attrs["cell"], steps, batch, hid)


def _bind_rnn(ins, outs, scratch, attrs) -> Bound:
    return rnn_step(_d().xp, ins, outs[0], scratch.view("float32"), attrs)


def _bind_argmax(ins, outs, scratch, attrs) -> Bound:
    return G.argmax_step(_d().xp, ins[0], outs[0], attrs)


def _bind_generic(op: str):
    """The dtype-generic ops (kernels/generic.py) over the device's array module."""

    def bind(ins, outs, scratch, attrs) -> Bound:
        return G.generic_step(_d().xp, op, ins, outs[0], attrs)

    return bind


def _bind_slice(ins, outs, scratch, attrs) -> Bound:
    return _copy_step(_d(), ins[0][ops.slice_index(attrs)], outs[0])


def _bind_concat(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    y = outs[0]
    ax = attrs["axis"] % y.ndim
    steps, start = [], 0
    for x in ins:
        idx = [slice(None)] * y.ndim
        idx[ax] = slice(start, start + x.shape[ax])
        steps.append(_copy_step(d, x, y[tuple(idx)]))
        start += x.shape[ax]

    def step() -> None:
        for s in steps:
            s()

    return step


_PAD_MODE = {"constant": 0, "reflect": 1, "edge": 2}


def _bind_pad(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    x, y = ins[0], outs[0]
    r = x.ndim
    p = attrs["pads"]
    before = np.zeros(MAX_RANK, np.int64)
    before[MAX_RANK - r :] = p[:r]
    # A constant is an argument, uploaded once: kernels read it like any array.
    b_dev = d.arg(d.upload(before))
    xa, ya = d.arg(_as6(x)), d.arg(_as6(y))
    mode = _PAD_MODE[attrs.get("mode", "constant")]
    value = np.float32(attrs.get("value", 0.0))
    kern = d.launch(_k().pad6, y.size)
    return lambda: kern(xa, ya, b_dev, mode, value)


def _not_cpu_planned(accepts):
    return lambda attrs: not layout.cpu_planned(attrs) and accepts(attrs)


def _cuda(op: str, bind, dtypes=("f32",), scratch=None, accepts=None) -> None:
    scratch = scratch or (lambda i, o, a: 0)
    takes = accepts or (lambda a: True)
    if op in layout.CPU_PLANNED_OPS:
        # Channels-first, weights unpanelled: the cuda backend asks for neither pass
        # (registry.BACKEND_TABLE), so a node with a layout or a panel attribute was
        # planned for another backend and is not this one's to run.
        takes = _not_cpu_planned(takes)
    k = Kernel(f"cuda.{op}", bind, scratch, takes)
    register(op, dtypes, "cuda", k)


def _q4_decode(w, scale, dst, rows, cols):
    d = _d()
    kern = d.launch(_k().decode_q4, w.size)
    args = (
        d.arg(w),
        d.arg(scale.view(np.uint16)),
        d.arg(dst),
        d.arg(d.upload(rows)),
        d.arg(d.upload(cols)),
    )
    return lambda: kern(*args)


# Weight types the binds above take (float32 or a decoder); int4 decodes whole weights
# into scratch in the channels-first layout, then runs the float32 kernel
# (kernels/decoded.py).
_ALL_W = tuple(r.name for r in wtypes.ROWS if r.decoders.get("cuda", "") != "own")


def _float_x(attrs: dict) -> bool:
    """Float activations only: no int8-activation (``xq``) product here."""
    return not attrs.get("xq")


for _op, _bind, _scr in (
    ("conv", _bind_conv, _conv_scratch),
    ("linear", _bind_linear, _linear_scratch),
):
    _k4 = decoded(_op, Kernel(f"cuda.{_op}", _bind, _scr), _q4_decode, _f32_slot, f"cuda.{_op}")
    _cuda(_op, _k4.bind, ("i4",), _k4.scratch, _float_x)
_cuda("conv", _bind_conv, _ALL_W, _conv_scratch)
_cuda("dwconv", _bind_dwconv, _ALL_W, _dw_scratch)
_cuda("linear", _bind_linear, _ALL_W, _linear_scratch, _float_x)
_cuda("matmul", _bind_matmul)
_cuda("binary", _bind_binary)
_cuda("unary", _bind_unary)
_cuda("slice", _bind_slice)
_cuda("argmax", _bind_argmax)
_cuda("reduce", _bind_reduce, scratch=_reduce_scratch)
_cuda("rnn", _bind_rnn, scratch=_rnn_scratch)
for _op in G.STEP_OPS:
    _cuda(_op, _bind_generic(_op))
_cuda("resample", _bind_resample)
_cuda("conv_transpose", _bind_conv_transpose)
_cuda("math", _bind_math)
_cuda("softmax", _bind_softmax)
_cuda("sdpa", _bind_sdpa, scratch=_sdpa_scratch)
_cuda("maxpool", _bind_pool("max"))
_cuda("avgpool", _bind_pool("avg"))
_cuda("global_avgpool", _bind_global_avgpool)
_cuda("channel_affine", _bind_channel_affine)
_cuda("reshape", _bind_reshape)
_cuda("transpose", _bind_transpose)
_cuda("concat", _bind_concat)
_cuda("rows", _bind_rows)
_cuda("reduce_mean", _bind_reduce_mean)
_cuda("pad", _bind_pad, accepts=lambda a: a.get("mode", "constant") in _PAD_MODE)


# --- decoder-LLM ops (kernels/cuda/kernels.py) ----------------------------------------


def _rows2(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1])


def _bind_norm(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    io = _args("norm", ins)
    b = d.arg(io.b) if io.b is not None else _dummies(d).v1
    x, y = _rows2(io.x), _rows2(outs[0])
    args = (d.arg(x), d.arg(io.w), b, d.arg(y), float(attrs["eps"]),
            attrs["kind"] == "layer", io.b is not None, norm_group(x.shape, attrs))  # fmt: skip
    kern = d.launch(_k().norm_rows, x.shape[0])
    return lambda: kern(*args)


def _bind_rope(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    io = _args("rope", ins)
    args = (d.arg(io.x), d.arg(io.pos), d.arg(io.cos), d.arg(io.sin), d.arg(outs[0]),
            int(attrs["heads"]), int(attrs["head_dim"]))  # fmt: skip
    kern = d.launch(_k().rope_rows, io.x.size)
    return lambda: kern(*args)


def _bind_glu(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    code = ops.GATE_ACTS.index(attrs["act"])
    args = (d.arg(_rows2(ins[0])), d.arg(_rows2(outs[0])), code)
    kern = d.launch(_k().glu_rows, outs[0].size)
    return lambda: kern(*args)


def _bind_embed(ins, outs, scratch, attrs) -> Bound:
    d = _d()
    io = _args("embed", ins)
    ids, y, mul = d.arg(io.ids.reshape(-1)), d.arg(_rows2(outs[0])), float(attrs.get("mul", 1.0))
    if io.w.itemsize == 2:  # fp16 or bf16: their bits, widened per element
        args = (ids, d.arg(io.w.view(np.uint16)), y, mul, io.w.dtype != np.float16)
        kern = d.launch(_k().embed_rows_half, outs[0].size)
        return lambda: kern(*args)
    scale = d.arg(io.scale) if io.scale is not None else _dummies(d).v1
    args = (ids, d.arg(io.w), scale, y, mul, io.scale is not None)
    kern = d.launch(_k().embed_rows, outs[0].size)
    return lambda: kern(*args)


def _bind_attention(ins, outs, scratch, attrs) -> Bound:
    d, K = _d(), _k()
    io = _args("attention", ins)
    kc, vc = io.k_cache, io.v_cache
    half = kc.dtype == np.float16
    if half:  # halves as integers, whatever the GPU's fp16 support
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    h, hkv, hd = int(attrs["heads"]), int(attrs["kv_heads"]), int(attrs["head_dim"])
    t = io.qkv.shape[0]
    qkv, pos, slot, kca, vca = (d.arg(a) for a in (io.qkv, io.pos, io.slot, kc, vc))
    store = d.launch(K.attention_store, t * hkv * hd)
    attend = d.launch(K.attention_rows, t * h)
    bits = d.arg(io.qkv.view(np.uint32))
    out = d.arg(outs[0])
    rest = (h, hkv, hd, float(attrs["scale"]), int(attrs["window"]),
            float(attrs.get("softcap", 0.0)), half)  # fmt: skip

    def step() -> None:
        store(qkv, bits, pos, slot, kca, vca, h, hkv, hd, half)
        attend(qkv, pos, slot, kca, vca, out, *rest)

    return step


_cuda("norm", _bind_norm)
_cuda("rope", _bind_rope)
_cuda("glu", _bind_glu)
_cuda("embed", _bind_embed, ("f32", "i8", "f16", "bf16"))
# one head's output sums in a local array of 256 (kernels.attention_rows)
_cuda("attention", _bind_attention, accepts=lambda a: int(a["head_dim"]) <= 256)
