"""The op-definition table: one entry per IR op (docs/bundle-format.md, "IR op set").

Each entry names the op's inputs by role (``x``, ``w``, ``bias``, ``scale``,
``residual``...), which of them are optional and which are constants from the weight
section, the attributes it requires, and its shape function: the output shape from
the input shapes and attributes, in the layout the node runs in. Its reference is
``kernels/ref/reference.py``'s ``REFERENCE[op]`` (checked to exist for every entry).

Who uses it: the importer (``packager/onnx_import.py`` emits a node and gets its output
shape from here), the passes and the binds (inputs by role: ``args(op, ins).scale``,
``role(op, "scale")`` for a slot), the bundle reader (every node's inputs and output
shapes are checked against its entry before anything is mapped) and the kernel tests.

Adding an op: an entry here, its reference in reference.py, its kernels registered per
backend (each backend's module), cases in tests/test_kernels.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]
ShapeFn = Callable[[Sequence["Shape | None"], dict], Shape]

NHWC = "nhwc"  # kernels/layout.py's value of attrs["layout"]


class OpError(ValueError):
    """A node does not fit its op's definition (inputs, attributes or shapes)."""


@dataclass(frozen=True)
class OpDef:
    name: str
    roles: tuple[str, ...]  # input roles in input order; ("*parts",) = any number
    optional: frozenset[str]  # roles that may be absent ("")
    consts: frozenset[str]  # roles that are weight-section constants
    attrs: tuple[str, ...]  # attributes every node of the op carries
    shape: ShapeFn
    weight: str | None = None  # the role whose weight type keys the kernel registry

    @property
    def variadic(self) -> bool:
        return self.roles[0].startswith("*")


def _nhwc(attrs: dict) -> bool:
    return attrs.get("layout") == NHWC


def _window_out(hw: Sequence[int], k: Sequence[int], attrs: dict) -> tuple[int, int]:
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl, pb, pr = attrs["pads"]
    return (
        (hw[0] + pt + pb - dh * (k[0] - 1) - 1) // sh + 1,
        (hw[1] + pl + pr - dw * (k[1] - 1) - 1) // sw + 1,
    )


def _conv_weight(w: Shape, attrs: dict) -> tuple[int, tuple[int, int]]:
    """(output channels, (kh, kw)) from a conv's stored weight shape and its layout:
    OIHW, HWIO (channels-last), panels (``panel``) or canonical int4 (``wshape``)."""
    if "wshape" in attrs:
        co, _, kh, kw = attrs["wshape"]
        return int(co), (int(kh), int(kw))
    if not _nhwc(attrs):
        return w[0], (w[2], w[3])
    if attrs.get("panel"):
        return int(attrs["out_channels"]), (w[1], w[2])
    return w[3], (w[0], w[1])


def _conv_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, w = ins[0], ins[1]
    co, k = _conv_weight(w, attrs)
    if _nhwc(attrs):
        return (x[0], *_window_out(x[1:3], k, attrs), co)
    return (x[0], co, *_window_out(x[2:4], k, attrs))


def _qconv_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x = ins[0]  # [N, H, W, C]; the weights' dot-product panels do not show the kernel
    return (x[0], *_window_out(x[1:3], attrs["kernel"], attrs), int(attrs["out_channels"]))


def _deconv_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    """ConvTranspose of x[N, C, H, W] with w[C, Cout / group, kh, kw]: the output size
    the importer worked out (``out_hw``), checked against the geometry."""
    x, w = ins[0], ins[1]
    g = int(attrs["group"])
    if len(x) != 4 or len(w) != 4 or w[0] != x[1] or x[1] % g:
        raise OpError(f"conv_transpose of {list(x)} with weights {list(w)} in {g} groups")
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilations"]
    pt, pl, pb, pr = attrs["pads"]
    full = (sh * (x[2] - 1) + dh * (w[2] - 1) + 1, sw * (x[3] - 1) + dw * (w[3] - 1) + 1)
    oh, ow = attrs["out_hw"]
    if oh > full[0] - pt + sh - 1 or ow > full[1] - pl + sw - 1 or min(oh, ow) < 1:
        raise OpError(f"conv_transpose output {oh}x{ow} of a {full[0]}x{full[1]} canvas")
    return (x[0], w[1] * g, oh, ow)


def _wino_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, u = ins[0], ins[1]  # U[a*a, Cin, Cout]: a 3x3 conv's weights, transformed
    a = {**attrs, "strides": [1, 1], "dilations": [1, 1]}
    if _nhwc(attrs):
        return (x[0], *_window_out(x[1:3], (3, 3), a), u[2])
    return (x[0], u[2], *_window_out(x[2:4], (3, 3), a))


def _linear_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, w = ins[0], ins[1]
    if "wshape" in attrs:
        n = attrs["wshape"][0]
    else:  # [N, K], or panels [ceil(N/64), K, 64] (kernels/layout.py)
        n = attrs["out_features"] if attrs.get("panel") else w[0]
    return (*x[:-1], int(n))


def _broadcast(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    try:
        return tuple(np.broadcast_shapes(*[s for s in ins if s is not None]))
    except ValueError as e:
        raise OpError(f"shapes {list(ins)} do not broadcast") from e


def _binary_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    known = (*BINARY_KINDS, *INT_ONLY_KINDS)
    if attrs["kind"] not in known:
        raise OpError(f"binary kind {attrs['kind']!r}; known: {', '.join(known)}")
    return _broadcast(ins, attrs)


def _matmul_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    a, b = ins[0], ins[1]
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        raise OpError(f"matmul of {list(a)} and {list(b)}")
    return (*np.broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1])


def _sdpa_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    """q [B, H, Sq, D], k [B, H, Sk, D] (``k_t``: K^T [B, H, D, Sk]), v [B, H, Sk, Dv],
    mask broadcasting to [B, H, Sq, Sk] (rank 3: no B)."""
    q, k, v, mask = (list(ins) + [None] * 4)[:4]
    kt = bool(attrs.get("k_t"))
    sk, dk = (k[-1], k[-2]) if kt else (k[-2], k[-1]) if len(k) >= 2 else (0, 0)
    if (
        len(q) not in (3, 4)
        or not (len(k) == len(v) == len(q))
        or not (q[:-2] == k[:-2] == v[:-2])
        or dk != q[-1]
        or v[-2] != sk
        or (mask is not None and (len(mask) > len(q) or any(
            m not in (1, n) for m, n in zip(mask[::-1], (sk, q[-2], *q[-3::-1])))))
    ):  # fmt: skip
        raise OpError(f"sdpa of q {list(q)}, k {list(k)}, v {list(v)}, mask {mask}")
    return (*q[:-1], v[-1])


def _same(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    return tuple(ins[0])


def _math_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    from .mathfns import MATH_FNS

    if attrs["fn"] not in MATH_FNS or len(attrs.get("args", (0.0, 0.0))) != 2:
        raise OpError(f"math fn {attrs['fn']!r} with args {attrs.get('args')}")
    return tuple(ins[0])


def _pool_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x = ins[0]
    oh, ow = attrs["out_hw"]  # the importer's ceil_mode-aware figure
    return (x[0], oh, ow, x[3]) if _nhwc(attrs) else (x[0], x[1], oh, ow)


def _gap_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x = ins[0]
    if _nhwc(attrs):  # [N, H, W, C] -> [N, C, 1, 1]: the same bytes in either layout
        return (x[0], x[3], 1, 1)
    return (*x[:2], *([1] * (len(x) - 2)))


def _reshape_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    shape = tuple(int(d) for d in attrs["shape"])
    if int(np.prod(shape)) != int(np.prod(ins[0])):
        raise OpError(f"reshape of {list(ins[0])} to {list(shape)}")
    return shape


def _transpose_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    perm = attrs["perm"]
    if sorted(perm) != list(range(len(ins[0]))):
        raise OpError(f"perm {perm} for rank {len(ins[0])}")
    return tuple(ins[0][p] for p in perm)


def _concat_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    parts = [s for s in ins if s is not None]
    ax = attrs["axis"] % len(parts[0])
    for s in parts:
        if len(s) != len(parts[0]) or any(
            d != e for i, (d, e) in enumerate(zip(s, parts[0])) if i != ax
        ):
            raise OpError(f"concat of {parts} along axis {ax}")
    out = list(parts[0])
    out[ax] = sum(s[ax] for s in parts)
    return tuple(out)


def _rows_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, start, count = ins[0], int(attrs["start"]), int(attrs["count"])
    if not x or start < 0 or count < 1 or start + count > x[0]:
        raise OpError(f"rows {start}..{start + count - 1} of a tensor of shape {x}")
    return (count, *x[1:])


def _slice_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, starts, steps, sizes = ins[0], attrs["starts"], attrs["steps"], attrs["sizes"]
    if not len(starts) == len(steps) == len(sizes) == len(x):
        raise OpError(f"slice of rank {len(x)} with {len(starts)} starts")
    for d, b, st, n in zip(x, starts, steps, sizes):
        last = b + (n - 1) * st
        if st == 0 or n < 0 or (n and not (0 <= b < d and 0 <= last < d)):
            raise OpError(f"slice start {b} step {st} size {n} of an axis of {d}")
    return tuple(int(n) for n in sizes)


def slice_block(shape: Sequence[int], attrs: dict) -> int | None:
    """The element offset of a slice that is one contiguous block of its C-ordered input
    (axes of one element, then one axis cut, then whole axes: an LSTM's last step, a
    channel split at batch 1), or None. The memory plan lets such a slice's output
    alias its input there (packager/plan.py), and its step then copies nothing."""
    starts, steps, sizes = attrs["starts"], attrs["steps"], attrs["sizes"]
    if 0 in sizes:
        return None
    cut = max((i for i, (n, d) in enumerate(zip(sizes, shape)) if n != d), default=0)
    if any(n != 1 for n in sizes[:cut]):
        return None
    if any(n > 1 and st != 1 for n, st in zip(sizes[cut:], steps[cut:])):
        return None
    offset, stride = 0, 1
    for i in range(len(shape) - 1, -1, -1):
        offset += int(starts[i]) * stride
        stride *= int(shape[i])
    return offset


def slice_index(attrs: dict) -> tuple[slice, ...]:
    """The NumPy basic index of a slice node (a view: no copy until assigned)."""
    out = []
    for b, st, n in zip(attrs["starts"], attrs["steps"], attrs["sizes"]):
        stop = b + n * st
        out.append(slice(b, None if stop < 0 else stop, st))
    return tuple(out)


def _resample_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, w, ax = ins[0], ins[1], ins[2], int(attrs["axis"])
    if not 0 <= ax < len(x) or idx != w or len(idx) != 2:
        raise OpError(f"resample of {list(x)} along {ax} with taps {idx} / {w}")
    return (*x[:ax], idx[0], *x[ax + 1 :])


def _take_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, ax = ins[0], ins[1], int(attrs["axis"])
    if not 0 <= ax < len(x):
        raise OpError(f"take along axis {ax} of {list(x)}")
    return (*x[:ax], *idx, *x[ax + 1 :])


SCATTER_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _scatter_elements_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, upd, ax = ins[0], ins[1], ins[2], int(attrs["axis"])
    if (idx != upd or len(idx) != len(x) or not 0 <= ax < len(x)
            or any(i > d for k, (i, d) in enumerate(zip(idx, x)) if k != ax)
            or attrs["reduction"] not in SCATTER_REDUCTIONS):  # fmt: skip
        raise OpError(f"scatter_elements along axis {ax} of {list(x)}: indices {list(idx)}, "
                      f"updates {list(upd)}, reduction {attrs['reduction']!r}")  # fmt: skip
    return tuple(x)


def _nd_split(x: Shape, idx: Shape, b: int) -> int:
    """k, the number of x's axes an index tuple of GatherND / ScatterND names."""
    k = idx[-1] if idx else 0
    if not idx or b < 0 or b + k > len(x) or tuple(idx[:b]) != tuple(x[:b]) or k < 1:
        raise OpError(f"nd indices {list(idx)} into {list(x)} (batch_dims {b})")
    return k


def _gather_nd_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, b = ins[0], ins[1], int(attrs["batch_dims"])
    k = _nd_split(x, idx, b)
    return (*idx[:-1], *x[b + k :])


def _scatter_nd_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, upd = ins[0], ins[1], ins[2]
    k = _nd_split(x, idx, 0)
    if tuple(upd) != (*idx[:-1], *x[k:]) or attrs["reduction"] not in SCATTER_REDUCTIONS:
        raise OpError(f"scatter_nd of updates {list(upd)} at indices {list(idx)} into "
                      f"{list(x)}, reduction {attrs['reduction']!r}")  # fmt: skip
    return tuple(x)


def _pool_nd_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, nd = ins[0], len(attrs["kernel"])
    if (len(x) != nd + 2 or attrs["kind"] not in ("max", "avg", "lp", "argmax", "argmax_col")
            or not len(attrs["strides"]) == len(attrs["dilations"]) == len(attrs["out"]) == nd
            or len(attrs["pads"]) != 2 * nd):  # fmt: skip
        raise OpError(f"pool_nd of {list(x)} with kernel {attrs['kernel']}")
    return (x[0], x[1], *attrs["out"])


def _grid_sample_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, g = ins[0], ins[1]
    if (len(x) < 3 or len(g) != len(x) or g[0] != x[0] or g[-1] != len(x) - 2
            or attrs["mode"] not in ("nearest", "linear", "cubic")
            or attrs["padding_mode"] not in ("zeros", "border", "reflection")):  # fmt: skip
        raise OpError(f"grid_sample of {list(x)} at a grid of {list(g)}, {attrs}")
    return (x[0], x[1], *g[1:-1])


def _topk_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, ax, k = ins[0], int(attrs["axis"]), int(attrs["k"])
    if not 0 <= ax < len(x) or not 0 <= k <= x[ax]:
        raise OpError(f"top {k} along axis {ax} of {list(x)}")
    return (*x[:ax], k, *x[ax + 1 :])


def _gather_elements_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, idx, ax = ins[0], ins[1], int(attrs["axis"])
    if (
        len(idx) != len(x)
        or not 0 <= ax < len(x)
        or any(i > d for k, (i, d) in enumerate(zip(idx, x)) if k != ax)
    ):
        raise OpError(f"gather_elements along axis {ax} of {list(x)} at indices {list(idx)}")
    return tuple(idx)


def _rnn_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, w, r, b = ins[0], ins[1], ins[2], ins[3]
    gates = {"lstm": 4, "gru": 3, "rnn": 1}.get(attrs["cell"])
    hid = r[1] if len(r) == 2 else 0
    if (
        gates is None or len(x) != 3 or len(w) != 2 or w != (gates * hid, x[2])
        or r != (gates * hid, hid) or b != (2 * gates * hid,)
        or any(s is not None and s != (x[1], hid) for s in ins[4:6])
    ):  # fmt: skip
        raise OpError(f"{attrs['cell']} of x {list(x)}, w {list(w)}, r {list(r)}, b {list(b)}")
    emit = attrs.get("emit", "h")
    if attrs["cell"] != "lstm" and (len(ins) > 5 and ins[5] or emit != "h"):
        raise OpError(f"a cell state for {attrs['cell']}")
    # emit "hc": each step's h, then one more row holding the final cell state
    return (x[0] + (emit == "hc"), x[1], hid)


def _expand_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    out = tuple(int(d) for d in attrs["shape"])
    if tuple(np.broadcast_shapes(ins[0], out)) != out:
        raise OpError(f"expand of {list(ins[0])} to {list(out)}")
    return out


def _kind_of(kinds: tuple[str, ...], shape: ShapeFn) -> ShapeFn:
    def fn(ins: Sequence[Shape | None], attrs: dict) -> Shape:
        if attrs["kind"] not in kinds:
            raise OpError(f"kind {attrs['kind']!r}; known: {', '.join(kinds)}")
        return shape(ins, attrs)

    return fn


def _argmax_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, ax = ins[0], int(attrs["axis"])
    if not 0 <= ax < len(x) or x[ax] < 1:
        raise OpError(f"argmax over axis {ax} of {list(x)}")
    return _reduce_shape(ins, {"axes": [ax], "keepdims": attrs["keepdims"]})


# reduce's kinds (the fold, what x becomes first, what the result becomes after)
REDUCE_KINDS = ("sum", "mean", "max", "min", "prod", "l1", "l2", "sum_square", "log_sum",
                "log_sum_exp")  # fmt: skip


def _reduce_kind_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    if attrs["kind"] not in REDUCE_KINDS:
        raise OpError(f"reduce kind {attrs['kind']!r}; known: {', '.join(REDUCE_KINDS)}")
    return _reduce_shape(ins, attrs)


def _reduce_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x = ins[0]
    axes = {a % len(x) for a in attrs["axes"]}
    if attrs["keepdims"]:
        return tuple(1 if i in axes else d for i, d in enumerate(x))
    return tuple(d for i, d in enumerate(x) if i not in axes)


def _pad_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, p = ins[0], attrs["pads"]
    return tuple(d + p[i] + p[i + len(x)] for i, d in enumerate(x))


def _mbconv_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, wd = ins[0], ins[4]  # channels-last input, depthwise weights HWIO [kh, kw, 1, C]
    oh, ow = _window_out(x[1:3], wd[:2], attrs["dw"])
    return (x[0], oh, ow, int(attrs["project"]["out_channels"]))


def _qmbconv_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, wd = ins[0], ins[5]  # as mbconv's, with the expand conv's zw before wd
    oh, ow = _window_out(x[1:3], wd[:2], attrs["dw"])
    return (x[0], oh, ow, int(attrs["project"]["out_channels"]))


def _last(ins: Sequence[Shape | None], attrs: dict, d: int) -> None:
    if ins[0][-1] != d:
        raise OpError(f"last axis {ins[0][-1]}, expected {d}")


def norm_group(x_shape: Sequence[int], attrs: dict) -> int:
    """Values normalized together: ``group`` (per-head q/k norms), else the last axis."""
    return int(attrs.get("group", x_shape[-1]))


def _norm_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    if attrs["kind"] not in NORM_KINDS:
        raise OpError(f"norm kind {attrs['kind']!r}; known: {', '.join(NORM_KINDS)}")
    n, g = ins[1][-1], norm_group(ins[0], attrs)
    if "group" not in attrs:
        _last(ins, attrs, n)
    elif g < 1 or n % g or n > ins[0][-1]:
        raise OpError(f"norm groups of {g} over {n} of {ins[0][-1]} columns")
    return tuple(ins[0])


def _rope_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    x, pos, cos, sin = ins
    if cos != sin or 2 * cos[1] > attrs["head_dim"] or len(pos) != 1 or pos[0] != x[0]:
        raise OpError(f"rope of {list(x)} at positions {list(pos)} with tables {list(cos)}")
    if attrs["heads"] * attrs["head_dim"] > x[1]:
        raise OpError(f"rope of {attrs['heads']} heads of {attrs['head_dim']} in {list(x)}")
    return tuple(x)


def _glu_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    if attrs["act"] not in GATE_ACTS or ins[0][-1] % 2:
        raise OpError(f"glu {attrs['act']!r} of {list(ins[0])}")
    return (*ins[0][:-1], ins[0][-1] // 2)


def _embed_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    d = attrs["wshape"][1] if "wshape" in attrs else ins[1][1]
    return (*ins[0], int(d))


def _attention_shape(ins: Sequence[Shape | None], attrs: dict) -> Shape:
    qkv, pos, slot, kc, vc = ins
    h, hkv, d = attrs["heads"], attrs["kv_heads"], attrs["head_dim"]
    if h % hkv or qkv[1] != (h + 2 * hkv) * d or pos != (qkv[0],) or slot != pos:
        raise OpError(f"attention of {list(qkv)} ({h} heads, {hkv} kv heads of {d})")
    if kc != vc or len(kc) != 4 or tuple(kc[2:]) != (hkv, d):
        raise OpError(f"kv caches {list(kc)} and {list(vc)} for {hkv} kv heads of {d}")
    return (qkv[0], h * d)


# Normalisations over the last axis (``norm``), and the gate activations of ``glu``:
# each a name here and one definition in the reference (kernels/ref/reference.py).
NORM_KINDS = ("rms", "layer")
GATE_ACTS = ("silu", "gelu_tanh")
# binary's kinds, in the order of the kernels' integer codes (kernels/cpu/kernels.py _binop)
BINARY_KINDS = ("add", "sub", "mul", "div", "max", "min", "pow")
INT_ONLY_KINDS = ("mod", "fmod", "bit_and", "bit_or", "bit_xor")  # integer tensors only
COMPARE_KINDS = ("equal", "less", "less_equal", "greater", "greater_equal")
LOGIC_KINDS = ("and", "or", "xor", "not")

_CONV_ATTRS = ("strides", "pads", "dilations", "group")
_W = frozenset({"w", "bias", "scale"})


def _op(name, roles, shape, optional=(), consts=(), attrs=(), weight=None) -> OpDef:
    return OpDef(
        name, tuple(roles), frozenset(optional), frozenset(consts), tuple(attrs), shape, weight
    )


_CONV_ROLES = ("x", "w", "bias", "scale", "residual")
# qconv's own attributes: the kernel's [kh, kw], input channels, output channels, the
# input's quantization (scale, zero point) and the reduction steps of 4 per kernel row
QCONV_ATTRS = ("kernel", "in_channels", "out_channels", "x_scale", "x_zero", "run4")
# An int8 op whose output only int8 ops read writes u8 codes instead of float32: it then
# carries the output's quantization as ``y_scale`` and ``y_zero`` (optional on qconv).
Y_QUANT = ("y_scale", "y_zero")
_OPT = ("bias", "scale", "residual")
OPS: dict[str, OpDef] = {
    d.name: d
    for d in (
        _op("conv", _CONV_ROLES, _conv_shape, _OPT, _W, _CONV_ATTRS, "w"),
        _op("dwconv", _CONV_ROLES, _conv_shape, _OPT, _W, _CONV_ATTRS, "w"),
        _op("conv_wino", _CONV_ROLES, _wino_shape, _OPT, _W, ("pads", "tile"), "w"),
        # a channels-last conv on u8 activations and s8 weights (kernels/cpu/qgemm.py):
        # the packager's int8-activation pass makes it from an int8 conv
        _op("qconv", (*_CONV_ROLES, "zw"), _qconv_shape, ("bias", "residual"),
            _W | {"zw"}, (*_CONV_ATTRS, *QCONV_ATTRS), "w"),
        # a channels-last 3x3 depthwise conv writing the u8 codes of the int8 convs that
        # read its output (kernels/cpu/qdw.py); scale: the weights' (ones for float32)
        _op("qdwconv", ("x", "w", "bias", "scale"), _conv_shape, ("bias",), _W,
            (*_CONV_ATTRS, *Y_QUANT), "w"),
        # float32 weights (not a weight op: --quant leaves them as they are)
        _op(
            "conv_transpose",
            ("x", "w", "bias"),
            _deconv_shape,
            ("bias",),
            ("w", "bias"),
            ("strides", "pads", "dilations", "group", "out_hw"),
        ),
        _op("linear", ("x", "w", "bias", "scale"), _linear_shape, ("bias", "scale"), _W, (), "w"),
        _op("matmul", ("a", "b"), _matmul_shape),
        _op("binary", ("a", "b"), _binary_shape, attrs=("kind",)),
        _op("unary", ("x",), _same),
        _op("math", ("x",), _math_shape, attrs=("fn",)),
        _op("softmax", ("x",), _same, attrs=("axis",)),
        # softmax(scale * q k^T + mask) v: an encoder's attention, fused at pack time
        # (optional attribute nan_zero: NaN probabilities count as 0)
        _op("sdpa", ("q", "k", "v", "mask"), _sdpa_shape, ("mask",), attrs=("scale", "k_t")),
        _op("maxpool", ("x",), _pool_shape, attrs=("kernel", "strides", "pads", "out_hw")),
        _op("avgpool", ("x",), _pool_shape, attrs=("kernel", "strides", "pads", "out_hw")),
        _op("global_avgpool", ("x",), _gap_shape),
        _op("channel_affine", ("x", "scale", "shift"), _same, consts=("scale", "shift")),
        _op("reshape", ("x",), _reshape_shape, attrs=("shape",)),
        _op("transpose", ("x",), _transpose_shape, attrs=("perm",)),
        _op("concat", ("*parts",), _concat_shape, attrs=("axis",)),
        _op("rows", ("x",), _rows_shape, attrs=("start", "count")),
        _op("slice", ("x",), _slice_shape, attrs=("starts", "steps", "sizes")),
        # one axis of a Resize: y[.., o, ..] = sum_t w[o, t] * x[.., idx[o, t], ..]
        _op("resample", ("x", "idx", "w"), _resample_shape, consts=("idx", "w"), attrs=("axis",)),
        _op("reduce_mean", ("x",), _reduce_shape, attrs=("axes", "keepdims")),
        _op("reduce", ("x",), _reduce_kind_shape, attrs=("kind", "axes", "keepdims")),
        # dtype-generic (kernels/generic.py): out_dtype gives each node's output dtype
        _op("expand", ("x",), _expand_shape, attrs=("shape",)),
        _op("cast", ("x",), _same, attrs=("to",)),
        _op("compare", ("a", "b"), _kind_of(COMPARE_KINDS, _broadcast), attrs=("kind",)),
        _op("logic", ("a", "b"), _kind_of(LOGIC_KINDS, _broadcast), ("b",), attrs=("kind",)),
        _op("where", ("cond", "a", "b"), _broadcast),
        _op("take", ("x", "indices"), _take_shape, attrs=("axis",)),
        # GatherElements: y[i][j][k] = x[i][indices[i][j][k]][k] (axis 1), any dtype of x
        _op("gather_elements", ("x", "indices"), _gather_elements_shape, attrs=("axis",)),
        # ScatterElements: y = x, then y[i][indices[i][j][k]][k] (axis 1) = updates[i][j][k]
        # (or combined with it by ``reduction``: add, mul, max, min)
        _op("scatter_elements", ("x", "indices", "updates"), _scatter_elements_shape,
            attrs=("axis", "reduction")),
        # GatherND: y[i..] = x[b.., indices[b.., i.., :], ...] (the last axis of indices
        # names the first k axes of x after ``batch_dims``); ScatterND writes the same
        # slices of y = x from updates
        _op("gather_nd", ("x", "indices"), _gather_nd_shape, attrs=("batch_dims",)),
        _op("scatter_nd", ("x", "indices", "updates"), _scatter_nd_shape, attrs=("reduction",)),
        # TopK's indices (int64), sorted, the lower index first among equal values;
        # its values are a gather_elements of x at them (packager/onnx_import.py)
        _op("topk", ("x",), _topk_shape, attrs=("axis", "k", "largest")),
        # CumSum along ``axis``; ``exclusive`` leaves out the element itself, ``reverse``
        # sums from the end; any number dtype
        _op("cumsum", ("x",), _same, attrs=("axis", "exclusive", "reverse")),
        # pooling over any number of spatial axes (x [N, C, *spatial]): max, average
        # (``count_include_pad``) or Lp (``p``) of each window of ``kernel`` taps,
        # ``dilations`` apart, ``strides`` apart, over x padded by ``pads`` (begins, then
        # ends); ``out`` the output's spatial shape (ceil_mode decided at pack time);
        # kind argmax: MaxPool's Indices (int64, the flat NCHW... index of the first max;
        # argmax_col: storage_order 1, the spatial axes' part of it column-major)
        # GridSample (kernels/sampling.py): x [N, C, *spatial] sampled at grid
        # [N, *out, len(spatial)] (normalized coordinates, innermost axis first)
        _op("grid_sample", ("x", "grid"), _grid_sample_shape,
            attrs=("mode", "padding_mode", "align_corners")),
        _op("pool_nd", ("x",), _pool_nd_shape,
            attrs=("kind", "kernel", "strides", "dilations", "pads", "out", "count_include_pad",
                   "p")),  # fmt: skip
        # int64 output: the index of the largest (``min``: smallest) value along ``axis``,
        # the first one unless ``select_last``
        _op("argmax", ("x",), _argmax_shape, attrs=("axis", "keepdims")),
        _op("pad", ("x",), _pad_shape, attrs=("pads",)),
        # One direction of ONNX's LSTM / GRU / RNN (kernels/recurrent.py): x [S, B, I],
        # gates w [G*H, I] and r [G*H, H], b [2*G*H] = W's biases then R's (constants or
        # run-time tensors); y [S, B, H] each step's h, or with ``emit`` "c" each step's
        # cell state (LSTM)
        _op("rnn", ("x", "w", "r", "b", "h0", "c0"), _rnn_shape, ("h0", "c0"),
            attrs=("cell", "reverse")),  # fmt: skip
        # Decoder LLMs (docs/bundle-format.md, "LLM ops"): tokens are rows.
        _op("norm", ("x", "w", "b"), _norm_shape, ("b",), ("w", "b"), ("kind", "eps")),
        _op(
            "rope",
            ("x", "pos", "cos", "sin"),
            _rope_shape,
            (),
            ("cos", "sin"),
            ("heads", "head_dim"),
        ),
        _op("glu", ("x",), _glu_shape, attrs=("act",)),
        _op("embed", ("ids", "w", "scale"), _embed_shape, ("scale",), ("w", "scale"), (), "w"),
        _op(
            "attention",
            ("qkv", "pos", "slot", "k_cache", "v_cache"),
            _attention_shape,
            attrs=("heads", "kv_heads", "head_dim", "scale", "window"),
        ),
        _op(
            "mbconv",
            ("x", "we", "be", "se", "wd", "bd", "sd", "wp", "bp", "sp", "residual"),
            _mbconv_shape,
            ("we", "be", "se", "bd", "sd", "bp", "sp", "residual"),
            ("we", "be", "se", "wd", "bd", "sd", "wp", "bp", "sp"),
            ("dw", "project", "band", "layout"),
        ),
        # the int8 chain (kernels/mbconv.py): qconv -> qdwconv -> qconv, each conv's
        # inputs as it had them; ``y_scale``/``y_zero`` when the projection writes codes
        _op(
            "qmbconv",
            ("x", "we", "be", "se", "ze", "wd", "bd", "sd", "wp", "bp", "sp", "zp", "residual"),
            _qmbconv_shape,
            ("be", "bd", "bp", "residual"),
            ("we", "be", "se", "ze", "wd", "bd", "sd", "wp", "bp", "sp", "zp"),
            ("expand", "dw", "project", "band", "layout"),
        ),
    )
}

# Ops whose output is not float32 (the arena dtype of runtime/bundle_format.py); every
# other op takes and gives float32 tensors (the LLM graphs' int32 ids aside), except
# the dtype-generic ones (GENERIC_OPS, out_dtype).
OUT_DTYPES: dict[str, str] = {"argmax": "i64", "topk": "i64"}
# Ops that move or compare tensors of any arena dtype (kernels/generic.py runs them)
MOVE_OPS = ("reshape", "transpose", "concat", "slice", "rows", "expand")
GENERIC_OPS = (*MOVE_OPS, "cast", "compare", "logic", "where", "take", "gather_elements",
               "topk", "cumsum", "scatter_elements", "gather_nd", "scatter_nd")  # fmt: skip
# integer tensors' binary kinds: div truncates toward zero, mod takes the divisor's sign
# and fmod the dividend's (ONNX Div and Mod, as ONNX Runtime computes them)
INT_BINARY_KINDS = ("add", "sub", "mul", "max", "min", "div", "pow", *INT_ONLY_KINDS)
INDEX_DTYPES = ("i32", "i64")


def out_dtype(op: str, dts: Sequence[str | None], attrs: dict) -> str:
    """The output dtype of an ``op`` node whose inputs have dtypes ``dts`` (None: an
    absent input), or OpError naming what the op does not take."""
    live = [d for d in dts if d is not None]

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise OpError(f"{op} of {live}: {what}")

    if op in MOVE_OPS:
        need(len(set(live)) == 1, "its inputs must share one dtype")
        return live[0]
    if op == "cast":
        return attrs["to"]
    if op == "compare":
        need(len(set(live)) == 1, "both sides of one dtype")
        return "bool"
    if op == "logic":
        need(set(live) == {"bool"}, "bool tensors")
        return "bool"
    if op == "where":
        need(dts[0] == "bool" and dts[1] == dts[2], "a bool condition, two sides of one dtype")
        return dts[1]
    if op in ("take", "gather_elements", "gather_nd"):
        need(dts[1] in INDEX_DTYPES, "int32 or int64 indices")
        return dts[0]
    if op in ("scatter_elements", "scatter_nd"):
        need(dts[1] in INDEX_DTYPES and dts[0] == dts[2],
             "int32 or int64 indices, updates of x's dtype")  # fmt: skip
        need(attrs["reduction"] == "none" or dts[0] != "bool", "numbers to reduce")
        return dts[0]
    if op == "topk":
        need(live[0] not in ("bool", "f16"), "numbers (not bool or float16)")
        return "i64"
    if op == "cumsum":
        need(live[0] != "bool", "numbers")
        return live[0]
    if op == "pool_nd" and attrs["kind"].startswith("argmax"):  # MaxPool's Indices
        need(live == ["f32"], "float32 tensors")
        return "i64"
    if op in ("qconv", "qdwconv", "qmbconv"):  # int8: float32 or u8 codes in, y_scale: out
        need(live[0] in (("f32",) if op == "qdwconv" else ("f32", "u8")), "float32 or u8 codes")
        return "u8" if "y_scale" in attrs else "f32"
    if op == "binary" and live and live[0] != "f32":
        need(len(set(live)) == 1 and live[0] not in ("bool", "f16") and
             attrs["kind"] in INT_BINARY_KINDS and attrs.get("act", "none") == "none",
             f"integer tensors of one dtype, kinds {', '.join(INT_BINARY_KINDS)}")  # fmt: skip
        return live[0]
    need(all(d == "f32" for d in live), "float32 tensors")
    need(op != "binary" or attrs["kind"] not in INT_ONLY_KINDS, "integer tensors")
    return OUT_DTYPES.get(op, "f32")


# Constant inputs that are integer tables, not float32 (resample's tap indices, int32)
INT_CONSTS: dict[str, tuple[str, ...]] = {"resample": ("idx",)}

# The ops whose kernels are keyed by their weight's type (kernels/registry.py); a
# Winograd conv's by its transformed weights' (float32, fp16 or bf16: kernels/winograd.py).
WEIGHT_OPS: tuple[str, ...] = tuple(n for n, d in OPS.items() if d.weight)


def get(op: str) -> OpDef:
    try:
        return OPS[op]
    except KeyError:
        raise OpError(f"unknown op {op!r}; the IR has: {', '.join(OPS)}") from None


def role(op: str, name: str) -> int:
    """The input slot of role ``name`` of ``op``."""
    return get(op).roles.index(name)


class Args:
    """A node's inputs by role (``a.x``, ``a.w``, ``a.scale``...), absent ones None."""

    __slots__ = ("_op", "_vals")

    def __init__(self, op: OpDef, vals: list) -> None:
        self._op, self._vals = op, vals

    def __getattr__(self, name: str):
        try:
            return self._vals[self._op.roles.index(name)]
        except ValueError:
            raise AttributeError(f"op {self._op.name!r} has no input {name!r}") from None

    def __iter__(self):
        return iter(self._vals)

    def __len__(self) -> int:
        return len(self._vals)


def args(op: str, ins: Sequence) -> Args:
    """``ins`` padded with None to every role of ``op`` (a bundle omits trailing
    absent inputs), addressable by role."""
    d = get(op)
    vals = list(ins) + [None] * (len(d.roles) - len(ins))
    return Args(d, vals if d.variadic else vals[: len(d.roles)])


def output_shape(op: str, in_shapes: Sequence[Shape | None], attrs: dict) -> Shape:
    """The output shape of a node of ``op``; OpError naming what does not fit."""
    d = get(op)
    missing = [a for a in d.attrs if a not in attrs]
    if missing:
        raise OpError(f"{op} needs attribute(s) {', '.join(missing)}")
    if not d.variadic:
        if len(in_shapes) > len(d.roles):
            raise OpError(f"{op} takes {len(d.roles)} inputs, got {len(in_shapes)}")
        padded = list(in_shapes) + [None] * (len(d.roles) - len(in_shapes))
        absent = [r for r, s in zip(d.roles, padded) if s is None and r not in d.optional]
        if absent:
            raise OpError(f"{op} lacks its {', '.join(absent)} input")
    elif not any(s is not None for s in in_shapes):
        raise OpError(f"{op} has no inputs")
    try:
        return tuple(int(v) for v in d.shape(list(in_shapes), attrs))
    except OpError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        raise OpError(
            f"{op}: inputs {list(in_shapes)} do not fit ({type(e).__name__}: {e})"
        ) from None
