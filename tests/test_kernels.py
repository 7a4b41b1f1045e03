"""Every CPU kernel against the NumPy reference (ggml test-backend-ops style).

``test_cpu_kernel`` is parametrised over the registry itself: every ``(op, dtype, "cpu")``
key in ``KERNELS`` times the cases listed for that op in ``CASES``. A kernel registered
without cases fails ``test_every_kernel_has_cases``, so nothing untested can ship.
``test_cuda_kernel`` does the same for every ``(op, dtype, "cuda")`` key, with buffers
on the device (numba's CUDA simulator on a machine without a GPU, see conftest.py).

Each case is run the way the runtime runs it: outputs and scratch are preallocated (and
poisoned with NaN bytes, inside guard bands), weights are read-only, the kernel is bound
once and the step is run twice. The reference itself is checked against ONNX Runtime
for the ops whose semantics are easy to get subtly wrong (padding, ceil_mode pools,
count_include_pad, axes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from edgepack.kernels import layout, ops, registry, wtypes
from edgepack.kernels.activations import ACTIVATIONS
from edgepack.kernels.mathfns import MATH_FNS
from edgepack.kernels.ops import (
    BINARY_KINDS,
    COMPARE_KINDS,
    GENERIC_OPS,
    INT_ONLY_KINDS,
    OUT_DTYPES,
    REDUCE_KINDS,
)
from edgepack.kernels.ref import reference as R
from edgepack.kernels.winograd import transform_weights
from edgepack.packager.onnx_import import MATH_OPS, _pool_out
from edgepack.runtime.bundle_format import TENSOR_DTYPES

registry._load_backends()

F32 = np.float32
NO_ACT = {"act": "none", "act_args": [0.0, 0.0]}
# The int4 group size the kernel cases store their weights with (runs of 32 weights
# whose last one is partial are in the cases' K = 9 .. 512).
CASE_GROUP = 32
GUARD = 64  # elements (outputs) / bytes (scratch) of sentinel on each side of a buffer
OUT_SENTINEL = F32(-12345.0)
SCRATCH_SENTINEL = 0xFF  # 0xFFFFFFFF read as float32 is a NaN

# op -> (rtol, atol). Products accumulate in float32 (BLAS, numba fma chains and vector
# lanes) against a float64 reference; data movement must be bit-exact.
TOL: dict[str, tuple[float, float]] = {
    "conv": (1e-4, 1e-4),
    "dwconv": (1e-4, 1e-4),
    "conv_wino": (1e-4, 1e-4),
    # the same integers, one rounding to float32, then the same float32 operations in
    # the same order: equal but for the last bit
    "qconv": (1e-6, 1e-6),
    "qdwconv": (0, 1),  # u8 codes (one code: see _check_kernel)
    "linear": (1e-4, 1e-4),
    "matmul": (1e-4, 1e-4),
    "binary": (1e-6, 1e-6),
    "unary": (1e-5, 1e-6),
    "math": (0.0, 0.0),  # one float64 definition on every backend (kernels/mathfns.py)
    "softmax": (1e-5, 1e-7),
    "sdpa": (1e-5, 1e-6),
    "maxpool": (0.0, 0.0),
    "avgpool": (1e-6, 1e-6),
    "global_avgpool": (1e-5, 1e-6),
    "channel_affine": (1e-6, 1e-6),
    "reshape": (0.0, 0.0),
    "transpose": (0.0, 0.0),
    "concat": (0.0, 0.0),
    "rows": (0.0, 0.0),
    "slice": (0.0, 0.0),
    "argmax": (0.0, 0.0),
    "reduce": (1e-5, 1e-5),
    **dict.fromkeys(
        ("cast", "compare", "logic", "where", "take", "expand", "gather_elements", "topk",
         "gather_nd"),
        (0.0, 0.0),
    ),
    "cumsum": (1e-5, 1e-5),
    "pool_nd": (1e-5, 1e-6),
    "grid_sample": (1e-5, 1e-5),
    "scatter_elements": (1e-6, 1e-6),  # add / mul of repeats: the order of the sum
    "scatter_nd": (1e-6, 1e-6),
    "resample": (1e-6, 1e-6),
    "conv_transpose": (1e-5, 1e-5),
    "rnn": (1e-5, 1e-5),
    "reduce_mean": (1e-5, 1e-6),
    "pad": (0.0, 0.0),
    "mbconv": (2e-4, 2e-4),  # three convs in a row
    # qconv's, on depthwise codes the kernel and the reference both round from float32
    # values equal but for the last bit (a code apart only on a .5 boundary)
    "qmbconv": (1e-6, 1e-6),
    "norm": (1e-5, 1e-6),
    "rope": (1e-6, 1e-6),
    "glu": (1e-5, 1e-6),
    "embed": (0.0, 0.0),
    "attention": (1e-5, 1e-6),
}

# Sensible act_args per activation (a, b); clip bounds sit inside N(0, 1) so both bite.
ACT_ARGS: dict[str, tuple[float, float]] = {
    "none": (0.0, 0.0),
    "relu": (0.0, 0.0),
    "leaky_relu": (0.1, 0.0),
    "clip": (-0.5, 0.8),
    "sigmoid": (0.0, 0.0),
    "tanh": (0.0, 0.0),
    "hard_sigmoid": (0.2, 0.5),
    "hard_swish": (0.0, 0.0),
    "silu": (0.0, 0.0),
    "gelu": (0.0, 0.0),
}
assert set(ACT_ARGS) == set(ACTIVATIONS), "a new activation needs act_args here"


# --- cases ------------------------------------------------------------------------------

Inputs = list  # list[np.ndarray | None], in the op's input order
Make = Callable[[np.random.Generator, str], tuple[Inputs, dict]]


@dataclass(frozen=True)
class Case:
    name: str
    make: Make  # (rng, weight dtype) -> (inputs, attrs)
    const: tuple[int, ...] = ()  # input slots that are constants (read-only, as in a bundle)
    inplace: bool = False  # output shares input 0's memory (the plan's in-place/alias rule)
    onnx: dict = field(default_factory=dict)  # extra ONNX-only attributes (ceil_mode)
    state: tuple[int, ...] = ()  # input slots the op writes (attention's KV caches)
    dtypes: tuple[str, ...] = ()  # the weight types the case is for (empty: all)
    backends: tuple[str, ...] = ()  # the backends that take it (empty: all)


def _randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def _store_weight(w: np.ndarray, dt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(stored weight, its scale input or None) the way quantize_graph stores it: the
    weight-type table's quantize reference."""
    return wtypes.QUANTIZE[dt](w, CASE_GROUP)


def _wshape(w: np.ndarray, dt: str) -> dict:
    """The node attribute of weights stored canonical (int4: their logical shape)."""
    return {"wshape": list(w.shape)} if dt == "i4" else {}


def _specs(op: str, dt: str, ins) -> list:
    """(shape, type) of each input as the plan gives them: the node's weight type for
    its weight, the type the dtype names for the rest."""
    return [
        None
        if a is None
        else (tuple(a.shape), dt if (i == 1 and op in registry.WEIGHT_OPS) else wtypes.of_array(a))
        for i, a in enumerate(ins)
    ]


def _want(op: str, dt: str, ins, attrs) -> np.ndarray:
    """The reference output (weights the op references do not read as stored decoded
    first, as the ref backend does)."""
    feed = R.node_weights(dt, ins, op, attrs) if op in registry.WEIGHT_OPS else ins
    got = np.ascontiguousarray(R.REFERENCE[op](feed, attrs))
    if op in GENERIC_OPS or got.dtype.kind in "iub":  # dtype-generic: the reference's
        return got
    return got.astype(TENSOR_DTYPES[OUT_DTYPES.get(op, "f32")])  # argmax: int64


# Weight values that stress decoders: half subnormals (smallest ~6e-8), the smallest
# normal half, signed zeros; row 0 is all zero (int8 scale falls back to 1).
SPECIAL_W = np.array([0.0, -0.0, 6e-8, -1e-7, 1e-5, -3e-5, 6.1e-5, -6.2e-5], F32)


def _with_specials(w: np.ndarray) -> np.ndarray:
    w = w.copy()
    flat = w.reshape(-1)
    flat[-len(SPECIAL_W) :] = SPECIAL_W
    w[0] = 0.0
    return w


def _conv_out(hw, k, s, p, d) -> tuple[int, int]:
    return (
        (hw[0] + p[0] + p[2] - d[0] * (k[0] - 1) - 1) // s[0] + 1,
        (hw[1] + p[1] + p[3] - d[1] * (k[1] - 1) - 1) // s[1] + 1,
    )


def conv_case(
    name: str,
    *,
    n: int = 1,
    c: int = 4,
    hw: tuple[int, int] = (9, 9),
    co: int = 6,
    k: tuple[int, int] = (3, 3),
    s: tuple[int, int] = (1, 1),
    p: tuple[int, int, int, int] = (1, 1, 1, 1),
    d: tuple[int, int] = (1, 1),
    g: int = 1,
    bias: bool = True,
    res: bool = False,
    act: str = "none",
    dw: bool = False,
    special: bool = False,
) -> Case:
    if dw:
        co, g = c, c

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        cg = c // g
        x = _randn(rng, n, c, *hw)
        w = _randn(rng, co, cg, *k, scale=1.0 / np.sqrt(cg * k[0] * k[1]))
        wq, scale = _store_weight(_with_specials(w) if special else w, dt)
        b = _randn(rng, co, scale=0.5) if bias else None
        r = _randn(rng, n, co, *_conv_out(hw, k, s, p, d)) if res else None
        attrs = {
            "strides": list(s),
            "pads": list(p),
            "dilations": list(d),
            "group": g,
            "act": act,
            "act_args": list(ACT_ARGS[act]),
            **_wshape(w, dt),
        }
        return [x, wq, b, scale, r], attrs

    return Case(name, make, const=(1, 2, 3))


def mbconv_case(
    name: str,
    *,
    n: int = 1,
    c: int = 8,
    hw: tuple[int, int] = (9, 9),
    ce: int = 24,
    co: int = 8,
    k: int = 3,
    s: int = 1,
    expand: bool = True,
    res: bool = False,
    bias: bool = True,
    band: int = 2,
    acts: tuple[str, str, str] = ("clip", "clip", "none"),
    dts: tuple[str | None, str | None, str | None] = (None, None, None),
) -> Case:
    """A channels-last pointwise -> depthwise -> pointwise chain (kernels/mbconv.py).
    ``dts`` overrides the weight dtype per conv (None: the test's), as the packager's
    min_weights rule mixes them."""
    p = (k - 1) // 2

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        def conv(ci: int, co_: int, kk: int, g: int, which: int) -> list:
            w = _randn(rng, co_, ci // g, kk, kk, scale=1.0 / np.sqrt(ci // g * kk * kk))
            wq, scale = _store_weight(w, dts[which] or dt)
            b = _randn(rng, co_, scale=0.5) if bias else None
            hwio = np.ascontiguousarray(wq.transpose(layout.HWIO_FROM_OIHW))
            # the pointwise convs' weights as the packager stores them: panels
            return [hwio if g > 1 else layout.to_panels(hwio), b, scale]

        def sub(act: str, **kw) -> dict:
            return {
                "strides": [1, 1],
                "pads": [0, 0, 0, 0],
                "dilations": [1, 1],
                "group": 1,
                "act": act,
                "act_args": list(ACT_ARGS[act]),
                "layout": layout.NHWC,
                **kw,
            }

        x = _randn(rng, n, *hw, c if expand else ce)
        oh, ow = _conv_out(hw, (k, k), (s, s), (p,) * 4, (1, 1))
        ins = [x, *(conv(c, ce, 1, 1, 0) if expand else [None] * 3)]
        ins += conv(ce, ce, k, ce, 1) + conv(ce, co, 1, 1, 2)
        ins.append(_randn(rng, n, oh, ow, co) if res else None)
        attrs = {
            "layout": layout.NHWC,
            "dw": sub(acts[1], strides=[s, s], pads=[p] * 4, group=ce),
            "project": sub(acts[2], panel=layout.PANEL, out_channels=co),
            "band": band,
        }
        if expand:
            attrs["expand"] = sub(acts[0], panel=layout.PANEL, out_channels=ce)
        return ins, attrs

    return Case(name, make, const=tuple(range(1, 10)))


def wino_case(name: str, m: int, every_type: bool = False, **kw) -> Case:
    """A 3x3 stride-1 conv case with its weights Winograd-transformed as the packager
    stores them (packager/conv_algo.py: from the stored weights, U rounded back to
    their type). fp16 and bf16 U take only the cases marked ``every_type``: their
    kernels differ from float32's only in how U is packed."""
    base = conv_case(name, **kw)

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        ins, attrs = base.make(rng, dt)
        u = transform_weights(wtypes.DEQUANTIZE[dt](ins[1], None), m)
        ins[1] = _store_weight(u, dt)[0]
        return ins, {**attrs, "tile": m}

    return Case(name, make, const=base.const, dtypes=() if every_type else ("f32",))


@pytest.mark.parametrize("m", [2, 4])
def test_winograd_reference_is_the_direct_conv(m: int):
    # The conv_wino reference runs the Winograd algorithm on U as stored (so an fp16 or
    # bf16 U's rounding counts); on float32 U it must be the direct conv of the weights
    # U came from: the transform's matrices, overhanging tiles and asymmetric pads.
    rng = np.random.default_rng(m)
    x, w = _randn(rng, 2, 5, 11, 10), _randn(rng, 7, 5, 3, 3)
    attrs = {"strides": [1, 1], "pads": [0, 1, 2, 0], "dilations": [1, 1], "group": 1,
             "act": "none", "act_args": [0.0, 0.0], "tile": m}  # fmt: skip
    want = R.conv([x, w, None, None, None], attrs)
    got = R.conv_wino([x, transform_weights(w, m), None, None, None], attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def linear_case(
    name: str,
    xshape: tuple[int, ...],
    n: int,
    *,
    bias: bool = True,
    act: str = "none",
    special: bool = False,
    xq: int = 0,
    interleave: bool = False,
) -> Case:
    """``xq``: int8 activations in blocks of xq (int4 weights, and int8 ones interleaved:
    the kernels with integer products; the others decline the attribute);
    ``interleave``: the weights stored interleaved by 16 rows as packager/layout.py
    interleave_rows does (int8 too where K is a multiple of 32)."""

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        k = xshape[-1]
        x = _randn(rng, *xshape)
        if xq:  # a zero block and one of tiny values: scales 0 and ~1e-30
            x.reshape(-1, k)[0, :xq] = 0
            x.reshape(-1, k)[-1, -xq:] *= F32(1e-30)
        w = _randn(rng, n, k, scale=1.0 / np.sqrt(k))
        wq, scale = _store_weight(_with_specials(w) if special else w, dt)
        b = _randn(rng, n, scale=0.5) if bias else None
        attrs = {"act": act, "act_args": list(ACT_ARGS[act]), **_wshape(w, dt)}
        if interleave and dt == "i4":
            wq, scale = layout.q4_interleave(wq, scale)
            attrs["interleave"] = layout.Q4_INTERLEAVE
        elif interleave and dt == "i8" and k % 32 == 0:  # whole blocks only
            wq = layout.q8_interleave(wq)
            attrs["interleave"] = layout.Q4_INTERLEAVE
        return [x, wq, b, scale], attrs | ({"xq": xq} if xq else {})

    i8 = ("i8",) if interleave and xshape[-1] % 32 == 0 else ()
    only = {"dtypes": ("i4", *i8), "backends": ("cpu",)} if xq else {}
    return Case(name, make, const=(1, 2, 3), **only)


def matmul_case(name: str, ashape, bshape, act: str = "none") -> Case:
    def make(rng, dt):
        k = ashape[-1]
        a = _randn(rng, *ashape)
        b = _randn(rng, *bshape, scale=1.0 / np.sqrt(k))
        return [a, b], {"act": act, "act_args": list(ACT_ARGS[act])}

    return Case(name, make)


def binary_case(
    name: str,
    kind: str,
    ashape,
    bshape,
    *,
    act: str = "none",
    const_b: bool = False,
    inplace: bool = False,
    nan: bool = False,
    zeros: bool = False,
) -> Case:
    def make(rng, dt):
        a = _randn(rng, *ashape)
        b = _randn(rng, *bshape)
        if kind == "div":  # keep the divisor away from 0
            b = (np.sign(b) + (b == 0)) * rng.uniform(0.5, 2.0, bshape)
        if zeros:  # x / 0 and 0 / 0: signed infinities and NaN, on every build
            b = np.asarray(b, F32)
            b.reshape(-1)[::3] = 0.0
            b.reshape(-1)[1::9] = -0.0
            a.reshape(-1)[::6] = 0.0
        if nan:  # NaN on either side propagates (Max/Min/Pow as ONNX Runtime)
            a.reshape(-1)[::7] = np.nan
            b = np.asarray(b, F32)
            b.reshape(-1)[1::5] = np.nan
        return [a, np.asarray(b, F32)], {"kind": kind, "act": act, "act_args": list(ACT_ARGS[act])}

    return Case(name, make, const=(1,) if const_b else (), inplace=inplace)


# Inputs every math case starts with: zeros of both signs, halves, domain edges and
# the IEEE specials (NaN stays NaN, inf follows IEEE, as in ONNX Runtime).
MATH_SPECIALS = np.array([0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1.0, -1.0, 3.0, 710.0,
                          -710.0, np.inf, -np.inf, np.nan], F32)  # fmt: skip
# args per function where ONNX has attributes (its defaults)
MATH_ARGS = {"elu": (1.0, 0.0), "selu": (1.6732632, 1.050701), "celu": (1.0, 0.0),
             "thresholded_relu": (1.0, 0.0), "shrink": (0.5, 0.5)}  # fmt: skip


def rnn_case(
    name, cell, steps=5, batch=2, inp=3, hid=4, reverse=False, h0=False, c0=False, lbr=0, emit="h"
) -> Case:
    """One direction of an LSTM / GRU / RNN: weights at the scale a trained cell has
    (gates neither saturated nor flat)."""
    g = {"lstm": 4, "gru": 3, "rnn": 1}[cell] * hid

    def make(rng, dt):
        ins = [
            _randn(rng, steps, batch, inp),
            _randn(rng, g, inp, scale=0.5),
            _randn(rng, g, hid, scale=0.5),
            _randn(rng, 2 * g, scale=0.3),
            _randn(rng, batch, hid) if h0 else None,
            _randn(rng, batch, hid) if c0 else None,
        ]
        attrs = {"cell": cell, "reverse": int(reverse), "linear_before_reset": lbr, "emit": emit}
        return ins, attrs

    return Case(name, make, const=(1, 2, 3))


def deconv_case(name, xshape, wshape, s=(1, 1), p=(0, 0, 0, 0), d=(1, 1), g=1, bias=False,
                extra=(0, 0)) -> Case:  # fmt: skip
    """ConvTranspose; ``extra``: output_padding rows/columns past the canvas."""
    kh, kw = wshape[2:]
    oh = s[0] * (xshape[2] - 1) + d[0] * (kh - 1) + 1 - p[0] - p[2] + extra[0]
    ow = s[1] * (xshape[3] - 1) + d[1] * (kw - 1) + 1 - p[1] - p[3] + extra[1]

    def make(rng, dt):
        b = _randn(rng, wshape[1] * g) if bias else None
        attrs = {"strides": list(s), "pads": list(p), "dilations": list(d), "group": g,
                 "out_hw": [oh, ow]}  # fmt: skip
        return [_randn(rng, *xshape), _randn(rng, *wshape), b], attrs

    return Case(name, make, const=(1, 2))


def resample_case(name: str, shape, axis: int, n_out: int, taps: int) -> Case:
    def make(rng, dt):
        idx = rng.integers(0, shape[axis], (n_out, taps)).astype(np.int32)
        w = rng.uniform(-0.5, 1.0, (n_out, taps)).astype(F32)
        return [_randn(rng, *shape), idx, w], {"axis": axis}

    return Case(name, make, const=(1, 2))


def generic_case(name: str, ins: list, attrs: dict, inplace: bool = False) -> Case:
    """A dtype-generic op's case: inputs as (kind, shape), kind an arena dtype code,
    idx32 / idx64 / neg64 (indices in range for a take of size 5 or more; neg64 some
    negative) or nz64 (int64, no zero: divisors)."""

    def make(rng, dt):
        out = []
        for kind, shape in ins:
            if kind == "f32":
                x = _randn(rng, *shape)
                x.reshape(-1)[:1] = 0.0  # a zero: bool casts and comparisons see one
            elif kind == "bool":
                x = rng.random(shape) < 0.5
            elif kind == "grid":  # normalized coordinates, some outside [-1, 1]
                x = rng.uniform(-1.4, 1.4, shape).astype(F32)
            elif kind == "perm64":  # distinct indices along the last axis (of 5 or more)
                rows = [rng.permutation(5)[: shape[-1]] for _ in range(int(np.prod(shape[:-1])))]
                x = np.asarray(rows, np.int64).reshape(shape)
            elif kind.startswith(("idx", "neg")):
                lo = -4 if kind == "neg64" else 0
                x = rng.integers(lo, 5, shape).astype(np.int32 if kind == "idx32" else np.int64)
            elif kind == "nz64":
                x = rng.integers(1, 6, shape) * rng.choice([-1, 1], shape)
            else:
                x = rng.integers(-9 if kind[0] == "i" else 0, 10, shape).astype(TENSOR_DTYPES[kind])
            out.append(np.asarray(x))
        return out, dict(attrs)

    return Case(name, make, inplace=inplace)


def reduce_case(name, kind, shape, axes, keepdims=1, scale=1.0) -> Case:
    def make(rng, dt):
        x = _randn(rng, *shape, scale=scale)
        if kind in ("log_sum", "prod"):  # positive for log; near 1 for products
            x = (np.abs(x) + 0.5).astype(F32) if kind == "log_sum" else (1 + 0.1 * x).astype(F32)
        return [x], {"kind": kind, "axes": list(axes), "keepdims": keepdims}

    return Case(name, make)


def argmax_case(name, shape, axis, keepdims=1, is_min=False, last=False, ties=False) -> Case:
    def make(rng, dt):
        x = _randn(rng, *shape)
        if ties:  # a few values, so the first and the last of the largest differ
            x = np.round(x).astype(F32)
        return [x], {"axis": axis, "keepdims": keepdims, "min": is_min, "select_last": last}

    return Case(name, make)


def slice_case(name: str, shape, starts, steps, sizes) -> Case:
    def make(rng, dt):
        return [_randn(rng, *shape)], {"starts": list(starts), "steps": list(steps),
                                        "sizes": list(sizes)}  # fmt: skip

    return Case(name, make)


def math_case(name: str, fn: str | None = None, scale: float = 2.0, inplace=False) -> Case:
    fn = fn or name

    def make(rng, dt):
        x = _randn(rng, 2, 3, 4, 5, scale=scale) if scale else np.arange(120, dtype=F32) - 60.5
        x.reshape(-1)[: MATH_SPECIALS.size] = MATH_SPECIALS
        return [x], {"fn": fn, "args": list(MATH_ARGS.get(fn, (0.0, 0.0)))}

    return Case(name, make, inplace=inplace)


def unary_case(
    name: str,
    act: str,
    *,
    shape=(2, 3, 4, 5),
    scale: float = 2.0,
    args: tuple[float, float] | None = None,
    inplace: bool = False,
) -> Case:
    def make(rng, dt):
        return [_randn(rng, *shape, scale=scale)], {
            "act": act,
            "act_args": list(args if args is not None else ACT_ARGS[act]),
        }

    return Case(name, make, inplace=inplace)


def softmax_case(name: str, shape, axis: int, scale: float = 3.0, log: bool = False) -> Case:
    attrs = {"axis": axis, **({"log": True} if log else {})}
    return Case(name, lambda rng, dt: ([_randn(rng, *shape, scale=scale)], dict(attrs)))


def sdpa_case(name: str, lead, sq: int, sk: int, d: int, dv: int, k_t: bool = True,
              mask=None, causal: bool = False, nan_zero: bool = False) -> Case:
    """q [*lead, Sq, D], k [*lead, Sk, D] or K^T, v [*lead, Sk, Dv], ``mask`` a shape
    broadcasting to the scores (a float32-min padding mask, or with ``causal`` -inf
    above the diagonal). ``nan_zero``: torch's guard, with a fully masked row."""

    def make(rng, dt):
        q = _randn(rng, *lead, sq, d, scale=2.0)
        k = _randn(rng, *lead, sk, d)
        v = _randn(rng, *lead, sk, dv)
        ins = [q, np.ascontiguousarray(np.swapaxes(k, -1, -2)) if k_t else k, v]
        if mask is not None:
            m = np.zeros(mask, F32)
            if causal:
                m[..., :, :] = np.triu(np.full(mask[-2:], -np.inf, F32), 1)
            else:
                m.reshape(-1)[rng.random(m.size) < 0.3] = np.finfo(F32).min
            if nan_zero:  # a row of -inf: NaN probabilities, which the guard zeroes
                m[..., 0, :] = -np.inf
            ins.append(m)
        guard = {"nan_zero": 1} if nan_zero else {}
        return ins, {"scale": float(d) ** -0.5, "k_t": int(k_t), **guard}

    return Case(name, make)


def pool_case(
    name: str,
    kind: str,
    *,
    xshape=(2, 3, 9, 10),
    k=(3, 3),
    s=(2, 2),
    p=(1, 1, 1, 1),
    d=(1, 1),
    ceil: int = 0,
    cip: int = 0,
) -> Case:
    """IR attrs from ONNX-level parameters; out_hw exactly as the importer computes it."""
    onnx_attrs = {"ceil_mode": ceil}
    out_hw = _pool_out(None, onnx_attrs, xshape, list(k), list(s), list(d), list(p))
    attrs = {"kernel": list(k), "strides": list(s), "pads": list(p), "out_hw": out_hw}
    if kind == "max":
        attrs["dilations"] = list(d)
    else:
        assert d == (1, 1), "AveragePool with dilations is refused by the importer"
        attrs["count_include_pad"] = cip

    def make(rng, dt):
        return [_randn(rng, *xshape)], dict(attrs)

    return Case(name, make, onnx=onnx_attrs)


def shape_case(
    name: str, shapes, attrs: dict, *, inplace: bool = False, const: tuple[int, ...] = ()
) -> Case:
    """Ops whose inputs are plain activations: one N(0, 1) array per shape."""

    def make(rng, dt):
        return [_randn(rng, *s) for s in shapes], dict(attrs)

    return Case(name, make, const=const, inplace=inplace)


def affine_case(name: str, xshape, act: str = "none", inplace: bool = False) -> Case:
    def make(rng, dt):
        c = xshape[1]
        return [_randn(rng, *xshape), _randn(rng, c), _randn(rng, c)], {
            "act": act,
            "act_args": list(ACT_ARGS[act]),
        }

    return Case(name, make, const=(1, 2), inplace=inplace)


def nhwc(op: str, base: Case) -> Case:
    """``base`` as a channels-last node (kernels/layout.py): activations [N, H, W, C],
    depthwise weights HWIO, conv weights in panels; the reference computes it
    channels-first on transposed copies."""

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        ins, attrs = base.make(rng, dt)
        ins = list(ins)
        for i in layout.activation_inputs(op, len(ins)):
            if ins[i] is not None:
                ins[i] = np.ascontiguousarray(ins[i].transpose(layout.TO_NHWC))
        extra = {}
        canonical = layout.canonical_weights(attrs)  # int4: stored as is in any layout
        if op in layout.WEIGHT_IN_HWIO and not canonical:
            ins[1] = np.ascontiguousarray(ins[1].transpose(layout.HWIO_FROM_OIHW))
        if op == "conv":  # group 1: the packager stores these weights as panels
            co = attrs["wshape"][0] if canonical else ins[1].shape[3]
            extra = {"panel": layout.PANEL, "out_channels": co}
            if not canonical:
                ins[1] = layout.to_panels(ins[1])
        return ins, {**attrs, "layout": layout.NHWC, **extra}

    return Case(f"nhwc_{base.name}", make, const=base.const, onnx=base.onnx)


def panel_linear(base: Case) -> Case:
    """``base`` with its weights stored as the packager stores a small linear's:
    panels [ceil(N/64), K, 64] (kernels/layout.py linear_panels), for the cpu backend
    alone (the others decline: test_only_the_panel_pass_backends_take_panel_linears)."""

    def make(rng: np.random.Generator, dt: str) -> tuple[Inputs, dict]:
        ins, attrs = base.make(rng, dt)
        n = ins[1].shape[0]
        ins = [ins[0], layout.linear_panels(ins[1]), *ins[2:]]
        return ins, {**attrs, "panel": layout.PANEL, "out_features": n}

    return Case(f"panel_{base.name}", make, const=base.const,
                dtypes=("f32", "f16", "bf16", "i8"), backends=("cpu",))  # fmt: skip


def _nhwc_of(op: str, cases: list[Case], names: tuple[str, ...]) -> list[Case]:
    picked = [nhwc(op, c) for c in cases if c.name in names]
    assert len(picked) == len(names), f"{op}: no case among {names}"
    return picked


_ACTS = [a for a in ACT_ARGS if a != "none"]

CASES: dict[str, list[Case]] = {
    "conv": [
        conv_case("g1_k3_s1_p1"),
        conv_case("g2_k3_s1_p1", g=2),
        conv_case("g2_k3_s2_p1_res", g=2, s=(2, 2), res=True),
        conv_case("k3_s2_p1", s=(2, 2)),
        conv_case("k3_s2_odd_nopad", hw=(10, 11), s=(2, 2), p=(0, 0, 0, 0)),
        conv_case("k3_s21", s=(2, 1), hw=(9, 7)),
        conv_case("k3_asym_pads", p=(0, 1, 2, 0)),
        conv_case("k3_asym_pads_s2", p=(1, 0, 0, 1), s=(2, 2), hw=(8, 8)),
        conv_case("k3_dil2", d=(2, 2), p=(2, 2, 2, 2)),
        conv_case("k3_dil21_g2", d=(2, 1), p=(2, 1, 2, 1), g=2, hw=(11, 7)),
        conv_case("pw_1x1", k=(1, 1), p=(0, 0, 0, 0), c=8, co=5),
        conv_case("pw_1x1_g2", k=(1, 1), p=(0, 0, 0, 0), c=8, co=6, g=2),
        conv_case("pw_1x1_b2_res", k=(1, 1), p=(0, 0, 0, 0), n=2, res=True),
        conv_case("1x1_s2", k=(1, 1), p=(0, 0, 0, 0), s=(2, 2)),
        conv_case("1x1_pad", k=(1, 1), p=(1, 0, 0, 1)),
        conv_case("k7_s2_p3", c=3, co=8, hw=(16, 16), k=(7, 7), s=(2, 2), p=(3, 3, 3, 3)),
        conv_case("k7_s1_p3", c=2, co=3, hw=(9, 12), k=(7, 7), p=(3, 3, 3, 3)),
        conv_case("k3x1_rect", k=(3, 1), p=(1, 0, 1, 0), hw=(7, 5)),
        conv_case("k_whole_image", hw=(5, 5), k=(5, 5), p=(0, 0, 0, 0)),
        conv_case("batch2", n=2),
        conv_case("batch2_g2_res", n=2, g=2, res=True, act="relu"),
        conv_case("nobias", bias=False),
        conv_case("nobias_res", bias=False, res=True),
        conv_case("res_s2", res=True, s=(2, 2)),
        conv_case("special_weights", special=True),
        conv_case("special_weights_pw", k=(1, 1), p=(0, 0, 0, 0), special=True),
        *[conv_case(f"act_{a}", act=a, res=a in ("relu", "hard_swish")) for a in _ACTS],
    ],
    "conv_wino": [
        c
        for m in (2, 4)
        for c in (
            wino_case(f"f{m}_9x9_overhang", m),
            wino_case(f"f{m}_exact_tiles", m, hw=(2 * m, 3 * m), c=5, co=7),
            wino_case(f"f{m}_valid_nopad", m, hw=(11, 10), p=(0, 0, 0, 0)),
            wino_case(f"f{m}_asym_pads", m, hw=(7, 9), p=(0, 1, 2, 0)),
            wino_case(f"f{m}_res_relu_b2", m, every_type=True, n=2, res=True, act="relu"),
            wino_case(f"f{m}_nobias_clip", m, bias=False, act="clip"),
            wino_case(f"f{m}_c20_14x14", m, c=20, co=24, hw=(14, 14), act="hard_swish"),
            wino_case(f"f{m}_tiny_3x3", m, hw=(3, 3)),
        )
    ]
    + [
        # several tile blocks (backend_cpu.WINO_BLOCK_BYTES) and a partial column block
        wino_case("f4_blocks_c48_co72", 4, True, c=48, co=72, hw=(28, 28), res=True, act="relu"),
        # 20 output channels: U's rows end in a partial (masked) vector as they are packed
        wino_case("f2_c300_two_kc_blocks", 2, True, c=300, co=20, hw=(6, 6)),
    ],
    "dwconv": [
        conv_case("k3_s1_p1", dw=True),
        # stride-1 3x3 runs in vectors of up to 16 lanes: whole vectors, partial ones
        conv_case("k3_s1_w16", dw=True, hw=(3, 16)),
        conv_case("k3_s1_w37_res_clip", dw=True, hw=(5, 37), res=True, act="clip"),
        conv_case("k5_s1_p2", dw=True, k=(5, 5), p=(2, 2, 2, 2), hw=(11, 13)),
        conv_case("k3_s2_p1", dw=True, s=(2, 2)),
        conv_case("k3_s2_p1_even", dw=True, s=(2, 2), hw=(10, 12)),
        conv_case("k5_s2_p2", dw=True, k=(5, 5), s=(2, 2), p=(2, 2, 2, 2), hw=(17, 23)),
        conv_case("k3_s21", dw=True, s=(2, 1)),
        conv_case("k3_s12", dw=True, s=(1, 2), hw=(6, 14)),
        conv_case("k3_s3_nopad", dw=True, s=(3, 3), p=(0, 0, 0, 0), hw=(10, 11)),
        conv_case("k3_asym_pads", dw=True, p=(0, 2, 1, 0)),
        conv_case("k3_pads_gt_half", dw=True, p=(2, 3, 2, 3), hw=(5, 6)),
        conv_case("k3_dil2", dw=True, d=(2, 2), p=(2, 2, 2, 2)),
        conv_case("k5_dil2_s2", dw=True, k=(5, 5), d=(2, 2), s=(2, 2), p=(4, 4, 4, 4), hw=(13, 12)),
        conv_case("k3_nopad_narrow", dw=True, p=(0, 0, 0, 0), hw=(4, 3)),
        conv_case("k3_res", dw=True, res=True),
        conv_case("k3_s2_res", dw=True, res=True, s=(2, 2)),
        conv_case("batch2_res_relu", dw=True, n=2, res=True, act="relu"),
        conv_case("nobias", dw=True, bias=False),
        conv_case("c16", dw=True, c=16, hw=(7, 7)),
        conv_case("special_weights", dw=True, special=True),
        *[conv_case(f"act_{a}", dw=True, act=a) for a in _ACTS],
    ],
    "linear": [
        linear_case("m1_n10", (1, 64), 10),
        linear_case("m1_n8", (1, 40), 8),
        linear_case("m1_n1", (1, 17), 1),
        linear_case("m5_n12", (5, 33), 12),
        linear_case("m5_n7", (5, 33), 7),
        linear_case("x3d_n6", (2, 3, 20), 6),
        linear_case("x3d_n9_relu", (2, 3, 20), 9, act="relu"),
        linear_case("m4_k512_n13", (4, 512), 13),
        linear_case("m40_k70_n9", (40, 70), 9),  # more rows than int4's GEMV takes
        linear_case("nobias", (3, 16), 5, bias=False),
        linear_case("nobias_m1", (1, 16), 4, bias=False),
        linear_case("special_weights", (2, 16), 5, special=True),
        *[linear_case(f"act_{a}", (3, 24), 11, act=a) for a in _ACTS],
        # int8 activations (qdot.gemv_q4_q8): whole pairs of blocks, an odd block count,
        # K inside a block, more rows than the float GEMV takes, N not a multiple of 4
        linear_case("xq_m1_k64_n10", (1, 64), 10, xq=32),
        linear_case("xq_m1_k96_n7", (1, 96), 7, xq=32),
        linear_case("xq_m5_k40_n13", (5, 40), 13, xq=32),
        linear_case("xq_m7_k96_n5", (7, 96), 5, xq=32),  # tiles of 4 and 3 rows
        linear_case("xq_m40_k128_n9_relu", (40, 128), 9, act="relu", xq=32),
        linear_case("xq_x3d_nobias", (2, 3, 70), 6, bias=False, xq=32),
        linear_case("xq_special", (2, 64), 5, special=True, xq=32),
        # the same on weights interleaved by 16 rows (q4x16.gemm_q4x16_q8; int8 where K
        # is whole blocks, q8x16.gemm_q8x16_q8): tiles of 8 (int4 on 512-bit VNNI), 4,
        # 3, 2 and 1 rows, one block, K inside a block, rows past the float GEMV's
        linear_case("xq16_m1_k64_n16", (1, 64), 16, xq=32, interleave=True),
        linear_case("xq16_m7_k96_n32", (7, 96), 32, xq=32, interleave=True),
        linear_case("xq16_m6_k20_n16", (6, 20), 16, xq=32, interleave=True),
        linear_case("xq16_m8_k64_n32", (8, 64), 32, xq=32, interleave=True),
        linear_case("xq16_m15_k96_n16", (15, 96), 16, xq=32, interleave=True),
        linear_case("xq16_m40_k128_n48_relu", (40, 128), 48, act="relu", xq=32,
                    interleave=True),  # fmt: skip
        linear_case("xq16_x3d_nobias", (2, 3, 70), 16, bias=False, xq=32, interleave=True),
        linear_case("xq16_special", (2, 64), 16, special=True, xq=32, interleave=True),
    ],
    "matmul": [
        matmul_case("2d", (3, 4), (4, 5)),
        matmul_case("batched", (2, 3, 4), (2, 4, 6)),
        matmul_case("bcast_both", (2, 1, 3, 4), (5, 4, 6)),
        matmul_case("bcast_left2d", (3, 8), (2, 8, 5)),
        matmul_case("bcast_right2d", (2, 3, 8), (8, 5)),
        matmul_case("relu", (2, 3, 4), (2, 4, 6), act="relu"),
        matmul_case("tanh", (2, 3, 4), (4, 6), act="tanh"),
    ],
    "binary": [
        *[
            c
            for kind in BINARY_KINDS
            for c in (
                binary_case(f"{kind}_same", kind, (2, 3, 4, 5), (2, 3, 4, 5)),
                binary_case(f"{kind}_chan", kind, (2, 3, 4, 5), (1, 3, 1, 1), const_b=True),
                binary_case(f"{kind}_scalar", kind, (2, 3, 4, 5), (), const_b=True),
                binary_case(f"{kind}_scalar1", kind, (2, 3, 4, 5), (1,), const_b=True),
                binary_case(f"{kind}_both_bcast", kind, (3, 1, 5), (2, 1, 4, 1)),
                binary_case(f"{kind}_left_bcast", kind, (1, 3, 1, 1), (2, 3, 4, 5)),
            )
        ],
        binary_case("div_by_zero", "div", (2, 3, 4, 5), (2, 3, 4, 5), zeros=True),
        binary_case("max_nan", "max", (2, 3, 4, 5), (2, 3, 4, 5), nan=True),
        binary_case("min_nan_bcast", "min", (2, 3, 4, 5), (1, 3, 1, 5), nan=True),
        binary_case("pow_nan", "pow", (2, 3, 4, 5), (5,), nan=True),
        binary_case("add_relu", "add", (2, 3, 4, 5), (2, 3, 4, 5), act="relu"),
        # one operand varying on a leading or a trailing run of axes (cpu: binary_rows)
        binary_case("mul_chan_nchw", "mul", (1, 3, 4, 5), (1, 3, 1, 1)),
        binary_case("mul_gate_nhwc_inplace", "mul", (1, 4, 5, 8), (1, 1, 1, 8), inplace=True),
        binary_case("sub_row_reversed", "sub", (5,), (3, 5)),
        binary_case("div_chan_reversed_clip", "div", (1, 3, 1, 1), (1, 3, 4, 5), act="clip"),
        binary_case("pow_rows", "pow", (6, 4), (6, 1), const_b=True),
        binary_case("max_cols_nan", "max", (2, 7), (7,), nan=True),
        # integer tensors: Div toward zero, Mod with the divisor's / the dividend's sign
        *[
            generic_case(f"{k}_i64", [("i64", (3, 4)), ("nz64", (4,))], {"kind": k, **NO_ACT})
            for k in ("div", "mod", "fmod")
        ],
        *[  # bitwise ops and integer powers (ONNX's BitwiseAnd/Or/Xor, Pow)
            generic_case(f"{k}_{dt}", [(dt, (3, 4)), (dt, (4,))], {"kind": k, **NO_ACT})
            for k, dt in (("bit_and", "i32"), ("bit_or", "u8"), ("bit_xor", "i64"),
                          ("bit_and", "i8"))
        ],
        generic_case("pow_i64", [("i64", (3, 4)), ("idx64", (4,))], {"kind": "pow", **NO_ACT}),
        generic_case(
            "div_i64_inplace",
            [("i64", (2, 5)), ("nz64", (2, 5))],
            {"kind": "div", **NO_ACT},
            inplace=True,
        ),
        generic_case("mod_i64_scalar", [("i64", (7,)), ("nz64", ())], {"kind": "mod", **NO_ACT}),
        binary_case("mul_hard_sigmoid", "mul", (2, 8), (8,), act="hard_sigmoid"),
        binary_case("add_inplace", "add", (2, 3, 4, 5), (2, 3, 4, 5), inplace=True),
        # rank > 4 takes another path (the numba kernel is 4-D) on the cpu backend
        binary_case("add_5d_chan", "add", (2, 3, 2, 2, 3), (1, 3, 1, 1, 1), const_b=True),
        binary_case("div_5d_both_bcast", "div", (2, 1, 2, 1, 3), (3, 1, 2, 1)),
        binary_case("mul_5d_inplace_relu", "mul", (2, 3, 2, 2, 3), (3,), act="relu", inplace=True),
        binary_case(
            "div_chan_inplace_clip",
            "div",
            (2, 3, 4, 5),
            (1, 3, 1, 1),
            act="clip",
            const_b=True,
            inplace=True,
        ),
    ],
    "unary": [
        *[unary_case(a, a) for a in ACT_ARGS],
        unary_case("sigmoid_large", "sigmoid", scale=60.0),
        unary_case("tanh_large", "tanh", scale=60.0),
        unary_case("hard_swish_wide", "hard_swish", scale=6.0),
        unary_case("silu_wide", "silu", scale=60.0),
        unary_case("clip_no_lower", "clip", args=(float(np.finfo(F32).min), 0.5)),
        unary_case("relu_inplace", "relu", inplace=True),
        unary_case("sigmoid_inplace_1d", "sigmoid", shape=(37,), inplace=True),
    ],
    "conv_transpose": [
        deconv_case("k2_s2", (1, 4, 5, 6), (4, 3, 2, 2), s=(2, 2)),
        # kernel = stride: one GEMM and a pixel shuffle on the cpu backend
        deconv_case("k2_s2_bias_batch2", (2, 4, 3, 5), (4, 3, 2, 2), s=(2, 2), bias=True),
        deconv_case("k3_s3_rect", (1, 2, 4, 3), (2, 5, 3, 3), s=(3, 3), bias=True),
        deconv_case(
            "k3_s2_p1_bias", (2, 3, 4, 4), (3, 5, 3, 3), s=(2, 2), p=(1, 1, 1, 1), bias=True
        ),
        deconv_case("k3_s1_dil2_groups", (1, 4, 5, 5), (4, 2, 3, 3), d=(2, 2), g=2, bias=True),
        deconv_case(
            "k4_s3_out_pad", (1, 2, 3, 4), (2, 2, 4, 4), s=(3, 3), p=(1, 0, 2, 1), extra=(1, 2)
        ),
    ],
    "resample": [
        resample_case("nearest_up2", (2, 3, 5), 1, 10, 1),
        resample_case("linear_last", (3, 7), 1, 12, 2),
        resample_case("cubic_first", (6, 4), 0, 9, 4),
        resample_case("wide_taps", (1, 2, 16, 3), 2, 5, 7),
    ],
    "cast": [
        generic_case("f32_to_i64", [("f32", (2, 3, 4))], {"to": "i64"}),
        generic_case("f32_to_bool", [("f32", (5, 7))], {"to": "bool"}),
        generic_case("i64_to_f32", [("i64", (6,))], {"to": "f32"}),
        generic_case("bool_to_i32", [("bool", (3, 4))], {"to": "i32"}),
        generic_case("u8_to_f32", [("u8", (2, 8))], {"to": "f32"}),
    ],
    "compare": [
        *[
            generic_case(f"{k}_f32", [("f32", (2, 3, 4)), ("f32", (3, 1))], {"kind": k})
            for k in COMPARE_KINDS
        ],
        generic_case("equal_i64_bcast", [("i64", (4, 5)), ("i64", (5,))], {"kind": "equal"}),
        generic_case("less_i32", [("i32", (7,)), ("i32", ())], {"kind": "less"}),
    ],  # fmt: skip
    "logic": [
        *[
            generic_case(k, [("bool", (3, 4)), ("bool", (4,))], {"kind": k})
            for k in ("and", "or", "xor")
        ],
        generic_case("not", [("bool", (2, 5))], {"kind": "not"}),
    ],  # fmt: skip
    "where": [
        generic_case("f32_bcast", [("bool", (2, 1, 4)), ("f32", (3, 4)), ("f32", ())], {}),
        generic_case("i64", [("bool", (6,)), ("i64", (6,)), ("i64", (6,))], {}),
    ],
    "take": [
        generic_case("rows_i64_idx", [("f32", (9, 4)), ("idx64", (2, 3))], {"axis": 0}),
        generic_case("axis1_i32_idx", [("i64", (3, 7, 2)), ("idx32", (5,))], {"axis": 1}),
        generic_case("negative", [("f32", (5, 6)), ("neg64", (4,))], {"axis": 1}),
    ],
    "rnn": [
        rnn_case("lstm", "lstm"),
        rnn_case("lstm_reverse_states", "lstm", reverse=True, h0=True, c0=True),
        rnn_case("lstm_cell_state", "lstm", c0=True, emit="c"),
        rnn_case("lstm_h_then_cell_state", "lstm", reverse=True, h0=True, c0=True, emit="hc"),
        rnn_case("lstm_wide_odd", "lstm", steps=4, batch=3, inp=5, hid=21, emit="hc"),
        rnn_case("gru_wide_odd", "gru", steps=3, batch=3, inp=6, hid=19, h0=True),
        rnn_case("gru_linear_before_reset", "gru", lbr=1, h0=True),
        rnn_case("gru_reverse", "gru", reverse=True),
        rnn_case("rnn", "rnn", h0=True),
        rnn_case("rnn_one_step_wide", "rnn", steps=1, batch=3, inp=7, hid=9, reverse=True),
    ],
    "gather_elements": [
        generic_case("axis1_negative", [("f32", (3, 5)), ("neg64", (3, 4))], {"axis": 1}),
        generic_case("axis0_i64", [("i64", (5, 4)), ("idx64", (2, 4))], {"axis": 0}),
        generic_case("axis2_i32_idx", [("f32", (2, 3, 6)), ("idx32", (2, 2, 3))], {"axis": 2}),
    ],
    "scatter_elements": [
        generic_case("none_axis1", [("f32", (3, 5)), ("perm64", (3, 4)), ("f32", (3, 4))],
                     {"axis": 1, "reduction": "none"}),  # fmt: skip
        generic_case("add_axis0_repeats", [("f32", (5, 4)), ("neg64", (6, 4)), ("f32", (6, 4))],
                     {"axis": 0, "reduction": "add"}),  # fmt: skip
        generic_case("max_i64", [("i64", (2, 6)), ("idx32", (2, 3)), ("i64", (2, 3))],
                     {"axis": 1, "reduction": "max"}),  # fmt: skip
        generic_case("mul_axis2", [("f32", (2, 3, 5)), ("idx64", (2, 2, 4)), ("f32", (2, 2, 4))],
                     {"axis": 2, "reduction": "mul"}),  # fmt: skip
    ],
    "gather_nd": [
        generic_case("rows", [("f32", (5, 6)), ("idx64", (3, 1))], {"batch_dims": 0}),
        generic_case("elements_i32", [("i32", (5, 5, 2)), ("neg64", (2, 3, 2))], {"batch_dims": 0}),
        generic_case("batch1", [("f32", (2, 5, 3)), ("idx64", (2, 4, 1))], {"batch_dims": 1}),
    ],
    "scatter_nd": [
        generic_case("none_one_row", [("f32", (5, 6)), ("idx64", (1, 1)), ("f32", (1, 6))],
                     {"reduction": "none"}),  # fmt: skip
        generic_case("add_repeats", [("f32", (5, 5, 2)), ("neg64", (4, 2)), ("f32", (4, 2))],
                     {"reduction": "add"}),  # fmt: skip
        generic_case("min_i64", [("i64", (6, 2)), ("idx64", (3, 1)), ("i64", (3, 2))],
                     {"reduction": "min"}),  # fmt: skip
    ],
    "cumsum": [
        generic_case("f32_axis1", [("f32", (2, 6, 3))], {"axis": 1, "exclusive": 0, "reverse": 0}),
        generic_case("i64_exclusive", [("i64", (7,))], {"axis": 0, "exclusive": 1, "reverse": 0}),
        generic_case("f32_reverse", [("f32", (3, 5))], {"axis": 1, "exclusive": 0, "reverse": 1}),
        generic_case("i32_reverse_exclusive", [("i32", (4, 3))],
                     {"axis": 0, "exclusive": 1, "reverse": 1}),
    ],
    "topk": [
        generic_case("largest_axis1", [("f32", (2, 9, 3))], {"axis": 1, "k": 4, "largest": 1}),
        generic_case("smallest_last", [("f32", (3, 11))], {"axis": 1, "k": 11, "largest": 0}),
        # values -9..9 over 20: ties, the lower index first
        generic_case("ties_i64", [("i64", (3, 20))], {"axis": 1, "k": 6, "largest": 1}),
        generic_case("ties_i32_smallest", [("i32", (20, 2))], {"axis": 0, "k": 5, "largest": 0}),
    ],
    "expand": [
        generic_case("f32", [("f32", (3, 1))], {"shape": [2, 3, 4]}),
        generic_case("bool", [("bool", (1, 4))], {"shape": [3, 4]}),
    ],
    "reduce": [
        *[reduce_case(f"{k}_axis1", k, (2, 5, 3), [1]) for k in REDUCE_KINDS],
        reduce_case("max_hw_keep", "max", (2, 3, 4, 5), [2, 3]),  # GlobalMaxPool
        reduce_case("l2_last_flat", "l2", (4, 6), [1], keepdims=0),
        reduce_case("log_sum_exp_big", "log_sum_exp", (3, 7), [1], scale=300.0),
        reduce_case("sum_all", "sum", (2, 3, 4), [0, 1, 2], keepdims=0),
    ],
    "argmax": [
        argmax_case("axis1", (2, 5, 3), 1),
        argmax_case("axis0_flat", (7, 4), 0, keepdims=0),
        argmax_case("min_last_ties", (3, 6), 1, is_min=True, last=True, ties=True),
        argmax_case("max_last_ties", (2, 3, 4), 2, last=True, ties=True),
        argmax_case("first_ties", (4, 5), 1, ties=True),
    ],
    "slice": [
        slice_case("steps", (4, 9, 6), (1, 0, 5), (2, 3, -1), (2, 3, 6)),
        slice_case("reverse_all", (3, 5), (2, 4), (-1, -1), (3, 5)),
        slice_case("one_axis", (2, 3, 8, 8), (0, 0, 2, 0), (1, 1, 1, 1), (2, 3, 4, 8)),
        slice_case("empty_axis_kept", (2, 6), (1, 0), (1, 2), (1, 3)),
    ],
    "math": [
        *[math_case(fn) for fn in MATH_FNS],
        math_case("exp_wide", "exp", scale=200.0),
        math_case("round_halves", "round", scale=0.0),
        math_case("erf_inplace", "erf", inplace=True),
    ],
    "sdpa": [
        sdpa_case("vit_kt", (1, 4), 17, 17, 16, 16),
        sdpa_case("bert_padding_mask", (2, 3), 8, 8, 8, 8, mask=(2, 1, 1, 8)),
        sdpa_case("k_rows_2d_mask", (1, 2), 5, 7, 4, 6, k_t=False, mask=(5, 7)),
        sdpa_case("rank3", (3,), 4, 9, 8, 8, mask=(1, 4, 9)),
        sdpa_case("causal", (1, 2), 6, 6, 4, 4, k_t=False, mask=(6, 6), causal=True),
        sdpa_case("long_rows", (1, 1), 3, 300, 32, 8),
        sdpa_case("torch_nan_guard", (2, 2), 4, 6, 8, 8, mask=(2, 1, 4, 6), nan_zero=True),
    ],
    "softmax": [
        *[softmax_case(f"4d_axis{ax}", (2, 3, 4, 5), ax) for ax in (0, 1, 2, 3, -1)],
        softmax_case("2d_long", (4, 1000), 1),
        softmax_case("len1", (3, 1), 1),
        softmax_case("large_values", (2, 10), 1, scale=100.0),
        softmax_case("log_4d_axis1", (2, 3, 4, 5), 1, log=True),
        softmax_case("log_large_values", (2, 10), 1, scale=1e4, log=True),
    ],
    "grid_sample": [
        *[generic_case(f"{m}_{pad}_{'corners' if al else 'edges'}",
                       [("f32", (1, 2, 4, 5)), ("grid", (1, 3, 6, 2))],
                       {"mode": m, "padding_mode": pad, "align_corners": al})
          for m, pad, al in (("linear", "zeros", 0), ("nearest", "border", 1),
                             ("cubic", "reflection", 0), ("cubic", "zeros", 1),
                             ("linear", "reflection", 1), ("nearest", "zeros", 0))],
        generic_case("linear_3d_border", [("f32", (2, 1, 3, 4, 2)), ("grid", (2, 2, 3, 2, 3))],
                     {"mode": "linear", "padding_mode": "border", "align_corners": 0}),  # fmt: skip
    ],
    "pool_nd": [  # (ceil mode shows only in ``out``: avg_3d_ceil has a margin of 1)
        generic_case("max_3d_dilated", [("f32", (1, 2, 5, 6, 4))],
                     {"kind": "max", "kernel": [2, 3, 2], "strides": [2, 1, 2],
                      "dilations": [1, 2, 1], "pads": [1, 0, 1, 0, 1, 1], "out": [3, 3, 3],
                      "count_include_pad": 0, "p": 2}),  # fmt: skip
        generic_case("avg_2d_dilated", [("f32", (1, 3, 7, 7))],
                     {"kind": "avg", "kernel": [3, 3], "strides": [1, 1], "dilations": [2, 2],
                      "pads": [1, 1, 1, 1], "out": [5, 5], "count_include_pad": 0,
                      "p": 2}),  # fmt: skip
        generic_case("avg_3d_ceil_include_pad", [("f32", (1, 1, 5, 5, 5))],
                     {"kind": "avg", "kernel": [2, 2, 2], "strides": [2, 2, 2],
                      "dilations": [1, 1, 1], "pads": [0, 0, 1, 0, 0, 1], "out": [3, 3, 3],
                      "count_include_pad": 1, "p": 2}),  # fmt: skip
        generic_case("argmax_2d_pads", [("f32", (2, 3, 5, 5))],
                     {"kind": "argmax", "kernel": [3, 3], "strides": [2, 2], "dilations": [1, 1],
                      "pads": [1, 1, 1, 1], "out": [3, 3], "count_include_pad": 0,
                      "p": 2}),  # fmt: skip
        generic_case("argmax_col_3x4", [("f32", (1, 2, 4, 6))],
                     {"kind": "argmax_col", "kernel": [2, 2], "strides": [1, 2],
                      "dilations": [1, 1], "pads": [0, 0, 0, 0], "out": [3, 3],
                      "count_include_pad": 0, "p": 2}),  # fmt: skip
        generic_case("lp_1d_p3", [("f32", (2, 3, 9))],
                     {"kind": "lp", "kernel": [3], "strides": [2], "dilations": [1],
                      "pads": [1, 1], "out": [5], "count_include_pad": 0, "p": 3}),  # fmt: skip
        generic_case("lp_2d_p2", [("f32", (1, 2, 6, 6))],
                     {"kind": "lp", "kernel": [2, 2], "strides": [2, 2], "dilations": [1, 1],
                      "pads": [0, 0, 0, 0], "out": [3, 3], "count_include_pad": 0,
                      "p": 2}),  # fmt: skip
    ],
    "maxpool": [
        pool_case("k3_s2_p1", "max"),
        pool_case("k3_s2_p1_ceil", "max", ceil=1),
        pool_case("k2_s2_ceil_odd", "max", k=(2, 2), p=(0, 0, 0, 0), xshape=(1, 2, 7, 9), ceil=1),
        pool_case("k3_s2_ceil_lastwin_dropped", "max", p=(1, 1, 1, 1), xshape=(1, 2, 6, 6), ceil=1),
        pool_case("k3_s1_p1", "max", s=(1, 1)),
        pool_case("k3_s21", "max", s=(2, 1)),
        pool_case("k32_asym", "max", k=(3, 2), p=(0, 1, 1, 0)),
        pool_case("dil2", "max", d=(2, 2), p=(2, 2, 2, 2), s=(1, 1)),
        pool_case("dil2_ceil", "max", d=(2, 2), p=(1, 1, 1, 1), ceil=1, xshape=(1, 2, 10, 11)),
        pool_case("k2_s2_nopad", "max", k=(2, 2), p=(0, 0, 0, 0), xshape=(2, 4, 8, 8)),
    ],
    "avgpool": [
        *[
            pool_case(f"k3_s2_p1_cip{cip}_ceil{ceil}", "avg", cip=cip, ceil=ceil)
            for cip in (0, 1)
            for ceil in (0, 1)
        ],
        *[
            pool_case(
                f"k2_s2_ceil_odd_cip{cip}",
                "avg",
                k=(2, 2),
                p=(0, 0, 0, 0),
                xshape=(1, 2, 7, 9),
                ceil=1,
                cip=cip,
            )
            for cip in (0, 1)
        ],
        *[
            pool_case(f"asym_cip{cip}", "avg", k=(3, 2), p=(0, 1, 2, 0), s=(1, 2), cip=cip)
            for cip in (0, 1)
        ],
        pool_case("k3_s1_p1_cip1", "avg", s=(1, 1), cip=1),
        pool_case("k2_s2_nopad", "avg", k=(2, 2), p=(0, 0, 0, 0), xshape=(2, 4, 8, 8)),
    ],
    "global_avgpool": [
        shape_case("n2_c3_7x5", [(2, 3, 7, 5)], {}),
        shape_case("1x1", [(1, 16, 1, 1)], {}),
        shape_case("c8_3x3", [(1, 8, 3, 3)], {}),
    ],
    "channel_affine": [
        affine_case("4d", (2, 4, 5, 6)),
        affine_case("4d_relu", (2, 4, 5, 6), act="relu"),
        affine_case("4d_hard_swish", (1, 3, 4, 4), act="hard_swish"),
        affine_case("2d", (3, 4)),
        affine_case("inplace_leaky", (2, 4, 5, 6), act="leaky_relu", inplace=True),
    ],
    "reshape": [
        shape_case("3d_to_2d", [(2, 3, 4)], {"shape": [6, 4]}),
        shape_case("flatten", [(1, 8, 1, 1)], {"shape": [1, 8]}),
        shape_case("alias", [(2, 3, 4)], {"shape": [2, 12]}, inplace=True),
    ],
    "transpose": [
        shape_case("nchw_nhwc", [(2, 3, 4, 5)], {"perm": [0, 2, 3, 1]}),
        shape_case("nhwc_nchw", [(2, 4, 5, 3)], {"perm": [0, 3, 1, 2]}),
        shape_case("2d", [(7, 9)], {"perm": [1, 0]}),
        shape_case("3d_rot", [(3, 4, 5)], {"perm": [2, 0, 1]}),
        shape_case("heads", [(2, 5, 3, 4)], {"perm": [0, 2, 1, 3]}),
        shape_case("unit_dims", [(1, 6, 1, 4)], {"perm": [3, 1, 0, 2]}),
        # the cpu's swap_axes forms (backend.swap_form) and ones that stay NumPy copies
        shape_case("swap_lead", [(3, 4, 5)], {"perm": [1, 0, 2]}),
        shape_case("swap_last2", [(2, 3, 5)], {"perm": [0, 2, 1]}),
        shape_case("merged_5d", [(2, 3, 2, 4, 3)], {"perm": [0, 3, 1, 2, 4]}),
        shape_case("reverse", [(3, 4, 5)], {"perm": [2, 1, 0]}),
        shape_case("unit_moves_only", [(1, 5, 4)], {"perm": [1, 0, 2]}),
    ],
    "concat": [
        shape_case("axis0", [(1, 3, 4, 5), (2, 3, 4, 5)], {"axis": 0}),
        shape_case("axis1_three", [(2, 3, 4, 5), (2, 1, 4, 5), (2, 4, 4, 5)], {"axis": 1}),
        shape_case("axis2", [(2, 3, 1, 5), (2, 3, 4, 5)], {"axis": 2}),
        shape_case("axis3", [(2, 3, 4, 2), (2, 3, 4, 5), (2, 3, 4, 1)], {"axis": 3}),
        shape_case("2d_axis_neg1", [(3, 4), (3, 6)], {"axis": -1}),
    ],
    "rows": [
        shape_case("last", [(8, 5)], {"start": 7, "count": 1}),
        shape_case("middle_3d", [(6, 3, 4)], {"start": 2, "count": 3}),
        shape_case("all", [(4, 7)], {"start": 0, "count": 4}),
    ],
    "reduce_mean": [
        shape_case("hw_keep", [(2, 3, 4, 5)], {"axes": [2, 3], "keepdims": 1}),
        shape_case("c_drop", [(2, 3, 4, 5)], {"axes": [1], "keepdims": 0}),
        shape_case("n_h_drop", [(2, 3, 4, 5)], {"axes": [0, 2], "keepdims": 0}),
        shape_case("last_neg_keep", [(2, 3, 4, 5)], {"axes": [-1], "keepdims": 1}),
        shape_case("all_drop", [(2, 3, 4)], {"axes": [0, 1, 2], "keepdims": 0}),
        shape_case("long_axis", [(2, 1000)], {"axes": [1], "keepdims": 1}),
    ],
    "pad": [
        shape_case(
            "hw_asym",
            [(2, 3, 4, 5)],
            {"pads": [0, 0, 1, 2, 0, 0, 3, 1], "mode": "constant", "value": 0.0},
        ),
        shape_case(
            "channels_value",
            [(1, 3, 2, 2)],
            {"pads": [0, 2, 0, 0, 0, 1, 0, 0], "mode": "constant", "value": 1.5},
        ),
        shape_case("2d", [(3, 4)], {"pads": [1, 0, 0, 2], "mode": "constant", "value": -2.0}),
        shape_case("zero_pads", [(2, 3)], {"pads": [0, 0, 0, 0], "mode": "constant", "value": 0.0}),
    ],
}


def norm_case(name: str, shape, kind: str, bias: bool = False, inplace: bool = False,
              group: int = 0, cols: int = 0) -> Case:  # fmt: skip
    """``group``/``cols``: runs of ``group`` values over the first ``cols`` columns."""

    def make(rng, dt):
        d = cols or shape[-1]
        b = _randn(rng, d) if bias else None
        attrs = {"kind": kind, "eps": 1e-5} | ({"group": group} if group else {})
        return [_randn(rng, *shape, scale=3.0), _randn(rng, d), b], attrs

    return Case(name, make, const=(1, 2), inplace=inplace)


def rope_case(name: str, t: int, heads: int, extra: int, hd: int, half: int,
              inplace: bool = False) -> Case:  # fmt: skip
    """x[T, (heads + extra) * hd]: ``heads`` rotated, ``extra`` heads (v) left alone."""

    def make(rng, dt):
        p = 40
        x = _randn(rng, t, (heads + extra) * hd)
        pos = rng.integers(0, p, t).astype(np.int32)
        ang = rng.uniform(0, 2 * np.pi, (p, half))
        cos, sin = np.cos(ang).astype(F32), np.sin(ang).astype(F32)
        return [x, pos, cos, sin], {"heads": heads, "head_dim": hd}

    return Case(name, make, const=(2, 3), inplace=inplace)


def embed_case(name: str, v: int, d: int, ids_shape, mul: float | None = None,
               interleave: bool = False) -> Case:  # fmt: skip
    """``interleave``: an int8 table stored interleaved by 16 rows, as a tied output
    projection with int8 activations has it (packager/layout.py interleave_rows)."""

    def make(rng, dt):
        w, scale = _store_weight(_randn(rng, v, d), dt)
        ids = rng.integers(0, v, ids_shape).astype(np.int32)
        ids.reshape(-1)[:2] = (0, v - 1)  # the first and last rows
        attrs = {} if mul is None else {"mul": mul}
        if interleave:
            w, attrs["interleave"] = layout.q8_interleave(w), layout.Q4_INTERLEAVE
        return [ids, w, scale], attrs

    only = {"dtypes": ("i8",), "backends": ("cpu",)} if interleave else {}
    return Case(name, make, const=(1, 2), **only)


def attention_case(name: str, rows, cache=F32, h=6, hkv=2, d=16, ctx=24, window=0,
                   softcap=0.0) -> Case:  # fmt: skip
    """``rows``: (slot, pos) per row; the caches [2, ctx, hkv, d] hold random history
    before each row's position (rows of one slot at consecutive positions, as a prompt
    chunk is)."""

    def make(rng, dt):
        kc = rng.standard_normal((2, ctx, hkv, d)).astype(cache)
        vc = rng.standard_normal((2, ctx, hkv, d)).astype(cache)
        qkv = _randn(rng, len(rows), (h + 2 * hkv) * d)
        slot = np.array([r[0] for r in rows], np.int32)
        pos = np.array([r[1] for r in rows], np.int32)
        attrs = {"heads": h, "kv_heads": hkv, "head_dim": d, "scale": d**-0.5, "window": window}
        if softcap:
            attrs["softcap"] = softcap
        return [qkv, pos, slot, kc, vc], attrs

    return Case(name, make, state=(3, 4))


_CHUNK = [(1, p) for p in range(3, 12)]  # a 9-row prompt chunk after 3 cached rows
CASES.update({
    "norm": [
        norm_case("rms", (5, 64), "rms"),
        norm_case("rms_3d_inplace", (2, 3, 40), "rms", inplace=True),
        norm_case("layer_bias", (4, 48), "layer", bias=True),
        norm_case("layer_nobias", (1, 33), "layer"),
        # per-head q/k norms of a q|k|v row (Qwen3): heads of 8, v's columns copied
        norm_case("heads_of_qkv", (3, 48), "rms", group=8, cols=32),
        norm_case("heads_inplace", (2, 40), "rms", inplace=True, group=8, cols=24),
        norm_case("layer_groups", (2, 24), "layer", bias=True, group=6),
    ],
    "rope": [
        rope_case("qk_of_qkv", 6, 6, 2, 16, 8),
        rope_case("partial_inplace", 3, 2, 0, 16, 4, inplace=True),
        rope_case("one_row_hd64", 1, 12, 4, 64, 32),
    ],
    "glu": [
        shape_case("silu", [(5, 48)], {"act": "silu"}),
        shape_case("gelu_tanh_3d", [(2, 3, 32)], {"act": "gelu_tanh"}),
    ],
    "embed": [
        embed_case("rows", 50, 24, (7,)),
        embed_case("rows_2d_mul", 30, 16, (2, 3), mul=4.0),
        embed_case("rows_x16", 48, 64, (9,), interleave=True),
    ],
    "attention": [
        attention_case("prefill_chunk", _CHUNK),
        attention_case("prefill_chunk_f16", _CHUNK, cache=np.float16),
        attention_case("decode_two_slots_idle_row", [(0, 5), (-1, 0), (1, 23)]),
        attention_case("decode_f16_gqa3", [(1, 17), (0, 0)], cache=np.float16, h=9, hkv=3),
        attention_case("window", _CHUNK, window=4),
        attention_case("softcap_mha", [(0, 7), (1, 2)], h=4, hkv=4, softcap=20.0),
        # a head size that is not a multiple of 8: the scalar path
        attention_case("head_dim_12_gqa", [(0, 9), (1, 3)], h=4, hkv=2, d=12),
    ],
})  # fmt: skip

# Channels-last forms of the ops that have one: enough cases to cover each kernel's
# paths (pointwise, im2row bands, partial column tiles, strides, pads, residuals).
CASES["conv"] += _nhwc_of(
    "conv",
    CASES["conv"],
    (
        "g1_k3_s1_p1",
        "k3_s2_p1",
        "k3_asym_pads_s2",
        "k3_dil2",
        "pw_1x1",
        "pw_1x1_b2_res",
        "1x1_s2",
        "1x1_pad",
        "k7_s2_p3",
        "k7_s1_p3",
        "res_s2",
        "nobias_res",
        "act_clip",
        "act_hard_swish",
        "special_weights_pw",
    ),
) + [
    nhwc("conv", conv_case("pw_c40_co23", k=(1, 1), p=(0, 0, 0, 0), c=40, co=23, hw=(7, 7))),
    nhwc("conv", conv_case("k3_c20_co70_res", c=20, co=70, hw=(6, 5), res=True, act="relu")),
    nhwc(
        "conv",
        conv_case(
            "pw_c300_co40_clip", k=(1, 1), p=(0, 0, 0, 0), c=300, co=40, hw=(5, 7), act="clip"
        ),
    ),
]


def _y_codes(op: str, ins, attrs: dict, clip: float = 0.02) -> dict:
    """attrs with ``y_scale``/``y_zero`` for u8 output codes: the range of the op's
    float32 reference output less a ``clip`` fraction on each side (what calibration
    would give, with some saturation)."""
    from edgepack.packager.act_quant import u8_params

    y = R.REFERENCE[op](ins, attrs)
    ys, yz = u8_params(*np.quantile(y, [clip, 1 - clip]))
    return attrs | {"y_scale": float(F32(ys)), "y_zero": yz}


def qconv_case(name: str, xshape, co: int, k=(3, 3), s=(1, 1), p=(1, 1, 1, 1), d=(1, 1),
               act: str = "none", bias: bool = True, res: bool = False,
               clip: float = 0.02, x_codes: bool = False,
               y_codes: bool = False) -> Case:  # fmt: skip
    """A conv on u8 activations (kernels/cpu/qgemm.py) as packager/act_quant.py makes it:
    x [N, H, W, C] float32 with a calibrated range that leaves a ``clip`` fraction of
    values outside on each side (the saturation), int8 HWIO weights in dot-product
    panels, the zero-point term and the combined scale. ``x_codes``: x is u8 codes an
    int8 op wrote; ``y_codes``: the output is written as u8 codes."""
    from edgepack.packager.act_quant import u8_params

    def make(rng, dt):
        n, h, w, c = xshape
        x = _randn(rng, *xshape) + F32(0.5)
        scale, zero = u8_params(*np.quantile(x, [clip, 1 - clip]))
        if x_codes:
            x = rng.integers(0, 256, xshape).astype(np.uint8)
        hwio = rng.integers(-128, 128, (*k, c, co)).astype(np.int8)
        npan = -(-co // layout.PANEL)
        zw = np.zeros(npan * layout.PANEL, np.int32)
        zw[:co] = -zero * hwio.reshape(-1, co).astype(np.int64).sum(0)
        sw = (rng.random(co) * 0.01 + 0.001).astype(F32)
        oh = (h + p[0] + p[2] - d[0] * (k[0] - 1) - 1) // s[0] + 1
        ow = (w + p[1] + p[3] - d[1] * (k[1] - 1) - 1) // s[1] + 1
        ins = [x, layout.to_dot4_panels(hwio), _randn(rng, co) if bias else None,
               (F32(scale) * sw).astype(F32), _randn(rng, n, oh, ow, co) if res else None, zw]
        attrs = {"strides": list(s), "pads": list(p), "dilations": list(d), "group": 1,
                 "layout": layout.NHWC, "kernel": list(k), "in_channels": c,
                 "out_channels": co, "x_scale": scale, "x_zero": zero,
                 "run4": layout.dot4_run(k[1], c), "act": act,
                 "act_args": list(ACT_ARGS[act])}  # fmt: skip
        return ins, _y_codes("qconv", ins, attrs) if y_codes else attrs

    return Case(name, make, const=(1, 2, 3, 5), dtypes=("i8",), backends=("cpu", "ref"))


def qdwconv_case(name: str, hwc, s: int = 1, act: str = "clip", bias: bool = True) -> Case:
    """A 3x3 depthwise conv writing u8 codes (kernels/cpu/qdw.py), channels-last, as
    packager/act_quant.py makes it: float32 or int8 weights [3, 3, 1, C] with their
    scale (ones for float32), pads 1."""

    def make(rng, dt):
        h, w, c = hwc
        x = _randn(rng, 1, h, w, c)
        wf = _randn(rng, 3, 3, 1, c, scale=0.3)
        if dt == "i8":
            sw = (np.abs(wf).reshape(9, c).max(0) / 127).astype(F32)
            wq = np.rint(wf / sw).astype(np.int8)
        else:
            sw, wq = np.ones(c, F32), wf
        ins = [x, wq, _randn(rng, c) if bias else None, sw]
        attrs = {"strides": [s, s], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": c,
                 "layout": layout.NHWC, "act": act, "act_args": list(ACT_ARGS[act])}  # fmt: skip
        return ins, _y_codes("qdwconv", ins, attrs)

    return Case(name, make, const=(1, 2, 3), dtypes=("f32", "i8"), backends=("cpu", "ref"))


def qmbconv_case(name: str, hw=(9, 10), c: int = 8, ce: int = 40, co: int = 12, s: int = 1,
                 band: int = 3, n: int = 1, res: bool = False, x_codes: bool = True,
                 y_codes: bool = False, bias: bool = True, dw: str = "f32") -> Case:  # fmt: skip
    """The int8 chain as packager/mbconv.py fuses it: a 1x1 qconv expansion (float32
    out), a 3x3 qdwconv (``dw``: float32 or int8 weights) writing the u8 codes the 1x1
    qconv projection reads (its x_scale, x_zero are the codes' own). The registry keys
    the fused node as float32, so the case picks the depthwise weights' type itself."""

    def make(rng, dt):
        e_ins, e_at = qconv_case("e", (n, *hw, c), ce, k=(1, 1), p=(0, 0, 0, 0), act="clip",
                                 x_codes=x_codes).make(rng, "i8")  # fmt: skip
        (_, wd, bd, sd), d_at = qdwconv_case("d", (1, 1, ce), s=s, act="relu",
                                             bias=bias).make(rng, dw)  # fmt: skip
        d_in = [R.qconv(e_ins, e_at), wd, bd, sd]
        d_at = _y_codes("qdwconv", d_in, {k: v for k, v in d_at.items() if k not in ops.Y_QUANT})
        d = R.qdwconv(d_in, d_at)
        hwio = rng.integers(-128, 128, (1, 1, ce, co)).astype(np.int8)
        zp = np.zeros(-(-co // layout.PANEL) * layout.PANEL, np.int32)
        zp[:co] = -d_at["y_zero"] * hwio.reshape(ce, co).astype(np.int64).sum(0)
        sp = (rng.random(co) * 0.01 * d_at["y_scale"]).astype(F32)
        r = _randn(rng, *d.shape[:3], co) if res else None
        p_ins = [d, layout.to_dot4_panels(hwio), _randn(rng, co) if bias else None, sp, r, zp]
        p_at = {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1,
                "layout": layout.NHWC, "kernel": [1, 1], "in_channels": ce,
                "out_channels": co, "x_scale": d_at["y_scale"], "x_zero": d_at["y_zero"],
                "run4": layout.dot4_run(1, ce), "act": "none",
                "act_args": list(ACT_ARGS["none"])}  # fmt: skip
        if y_codes:
            p_at = _y_codes("qconv", p_ins, p_at)
        attrs = {"layout": layout.NHWC, "expand": e_at, "dw": d_at, "band": band,
                 "project": {k: v for k, v in p_at.items() if k not in ops.Y_QUANT},
                 **{k: p_at[k] for k in ops.Y_QUANT if k in p_at}}  # fmt: skip
        return [*e_ins[:4], e_ins[5], wd, bd, sd, *p_ins[1:4], zp, r], attrs

    return Case(name, make, const=tuple(range(1, 12)), dtypes=("f32",),
                backends=("cpu", "ref"))  # fmt: skip


# Convs on u8 activations: partial panels and vectors, a 3-channel stem (runs padded to
# 4), 1x1 strided in place, residual and batch, dilated rows, asymmetric pads, rows past
# one micro-tile and several panels.
CASES["qconv"] = [
    qconv_case("k3_c16_co24_relu", (1, 8, 9, 16), 24, act="relu"),
    qconv_case("stem_k7_s2_c3_co70", (1, 15, 13, 3), 70, k=(7, 7), s=(2, 2), p=(3, 3, 3, 3)),
    qconv_case("pw_s2_b2_res_clip", (2, 7, 7, 32), 64, k=(1, 1), s=(2, 2), p=(0, 0, 0, 0),
               act="clip", res=True, bias=False),
    qconv_case("k3_dil2_rows", (1, 9, 8, 8), 20, d=(2, 1), p=(2, 1, 2, 1)),
    qconv_case("k3_s2_asym_pads", (1, 10, 11, 12), 33, s=(2, 2), p=(0, 1, 1, 0)),
    qconv_case("k3_c64_co130_res", (1, 12, 10, 64), 130, res=True, act="relu"),
    qconv_case("pw_c5_co7_hswish", (1, 5, 6, 5), 7, k=(1, 1), p=(0, 0, 0, 0),
               act="hard_swish", clip=0.0),
    qconv_case("pw_s2x3_pads", (1, 9, 11, 24), 16, k=(1, 1), s=(2, 3), p=(1, 2, 0, 1)),
    # u8 codes in (read in place by a 1x1 stride-1 conv over whole runs of 4, else
    # copied with padding) and out (partial vectors and panels, residual, batch)
    qconv_case("pw_codes_in_place", (1, 6, 7, 32), 24, k=(1, 1), p=(0, 0, 0, 0),
               x_codes=True),
    qconv_case("pw_c6_codes_copied", (1, 5, 6, 6), 20, k=(1, 1), p=(0, 0, 0, 0),
               x_codes=True, y_codes=True, act="relu"),
    qconv_case("k3_codes_in_out", (2, 8, 9, 16), 70, x_codes=True, y_codes=True, act="clip"),
    qconv_case("k3_res_codes_out", (1, 7, 6, 12), 33, res=True, y_codes=True, act="relu"),
]

# 3x3 depthwise convs into u8 codes: partial channel vectors, stride 2, an image
# narrower than a window's interior, no bias.
CASES["qdwconv"] = [
    qdwconv_case("c40_s1_clip", (9, 11, 40)),
    qdwconv_case("c17_s2_relu", (10, 7, 17), s=2, act="relu"),
    qdwconv_case("c16_2x2_nobias", (2, 2, 16), act="none", bias=False),
    qdwconv_case("c96_s2", (12, 13, 96), s=2),
]

# The int8 chain in bands: stride 1 and 2 (bands sharing expanded rows), a band past
# the image, one band, float32 input quantized per band, residual and codes out, batch,
# partial channel vectors and panels.
CASES["qmbconv"] = [
    qmbconv_case("s1_band3"),
    qmbconv_case("s2_band2_odd_i8dw", hw=(11, 9), s=2, band=2, dw="i8"),
    qmbconv_case("s1_band4_of_9", hw=(9, 7), band=4, res=True),
    qmbconv_case("one_band", band=100, y_codes=True),
    qmbconv_case("f32_in_res_codes", x_codes=False, res=True, y_codes=True, band=2),
    qmbconv_case("batch2_s2", n=2, hw=(8, 8), s=2, band=3, bias=False),
    qmbconv_case("c6_ce20_co70_i8dw", c=6, ce=20, co=70, hw=(5, 6), band=2, dw="i8"),
    qmbconv_case("s2_three_rows_res", hw=(5, 6), s=2, band=1, res=True, y_codes=True),
]

# Small float32 linears on the panel GEMM: a partial panel, three panels with a partial
# last one, rows past one tile, 3-D x, no bias, a clamp and a polynomial activation.
CASES["linear"] += [
    panel_linear(c)
    for c in CASES["linear"]
    if c.name in ("m1_n10", "m5_n7", "x3d_n9_relu", "m40_k70_n9", "nobias", "act_silu",
                  "act_hard_swish", "special_weights")
] + [panel_linear(linear_case("m17_k64_n130_gelu", (17, 64), 130, act="gelu"))]  # fmt: skip
CASES["conv_wino"] += _nhwc_of(
    "conv_wino",
    CASES["conv_wino"],
    ("f2_res_relu_b2", "f4_9x9_overhang", "f2_asym_pads", "f4_blocks_c48_co72", "f4_tiny_3x3"),
)
CASES["dwconv"] += _nhwc_of(
    "dwconv",
    CASES["dwconv"],
    (
        "k3_s1_p1",
        "k3_s1_w37_res_clip",
        "k5_s1_p2",
        "k3_s2_p1",
        "k3_s2_p1_even",
        "k5_s2_p2",
        "k3_s21",
        "k3_asym_pads",
        "k3_pads_gt_half",
        "k3_dil2",
        "k3_nopad_narrow",
        "batch2_res_relu",
        "nobias",
        "c16",
        "special_weights",
        "act_hard_swish",
    ),
)
CASES["maxpool"] += _nhwc_of(
    "maxpool",
    CASES["maxpool"],
    ("k3_s2_p1", "k3_s2_p1_ceil", "k3_s21", "k32_asym", "dil2", "k2_s2_nopad"),
)
CASES["global_avgpool"] += _nhwc_of(
    "global_avgpool", CASES["global_avgpool"], ("n2_c3_7x5", "1x1", "c8_3x3")
)

# Bands: partial last band, stride 2 (bands overlap by one input row), a 5x5 depthwise
# (two), one band for the whole image, no expand (bands are views of the input).
CASES["mbconv"] = [
    mbconv_case("s1_res_band2", res=True),
    mbconv_case("s2_10x11_band3", hw=(10, 11), s=2, band=3),
    mbconv_case("k5_s2_band1", hw=(11, 8), k=5, s=2, band=1),
    mbconv_case("k5_s1_res_band4", k=5, res=True, band=4, acts=("relu", "hard_swish", "none")),
    mbconv_case("one_band", band=100),
    mbconv_case("no_expand_band4", expand=False, band=4, co=5),
    mbconv_case("no_expand_s2_clip", expand=False, s=2, band=2, acts=("none", "relu", "clip")),
    mbconv_case("batch2_res", n=2, res=True, band=3),
    mbconv_case("odd_channels", c=5, ce=40, co=23, hw=(7, 6), band=3),
    mbconv_case("nobias", bias=False, band=4),
    mbconv_case("mixed_i8_f32_i8", dts=("i8", "f32", "i8"), res=True),
    mbconv_case("f16_dw", dts=("f32", "f16", "f32"), s=2),
    mbconv_case("i8_all", dts=("i8", "i8", "i8"), band=3),
    mbconv_case("f16_all", dts=("f16", "f16", "f16"), res=True, band=3),
    mbconv_case("bf16_all_no_expand", dts=(None, "bf16", "bf16"), expand=False, s=2),
]


def _with_ieee_specials(base: Case, inf: bool = True) -> Case:
    """``base`` with NaN, +inf and -inf among input 0's values: every kernel must give
    the reference's answer, NaN where it has NaN (issue 18: ONNX Runtime propagates
    them; a max-based pool or a max/min-written ReLU or Clip must not drop them).
    ``inf`` False: NaN only (Winograd's transforms add and subtract neighbouring
    pixels, so an infinity becomes NaN where a direct convolution keeps it)."""

    def make(rng, dt):
        ins, attrs = base.make(rng, dt)
        x = np.array(ins[0], copy=True)
        if x.dtype.kind != "f":  # a bool or integer first input has no NaN
            return ins, attrs
        flat = x.reshape(-1)
        flat[::11] = np.nan
        if inf:
            flat[5::13], flat[7::17] = np.inf, -np.inf
        return [x, *ins[1:]], attrs

    return Case(f"ieee_{base.name}", make, base.const, base.inplace, base.onnx, base.state,
                base.dtypes, base.backends)  # fmt: skip


# One case per op with IEEE specials in its first input (float inputs only: an op whose
# first input is token ids, embed, has none; attention's qkv rows feed a softmax whose
# NaN handling follows the reference like the others).
for _op, _cases in list(CASES.items()):
    if _op not in ("embed",):
        CASES[_op] = [*_cases, _with_ieee_specials(_cases[0], inf=_op != "conv_wino")]


CPU_KEYS = sorted(k for k in registry.KERNELS if k[2] == "cpu")
CUDA_KEYS = sorted(k for k in registry.KERNELS if k[2] == "cuda")


def _params(keys) -> list:
    # channels-last cases only for a backend that asks for the channels-last pass (the
    # others decline them: test_only_the_layout_pass_backends_take_channels_last_nodes)
    return [
        pytest.param(op, dt, case, id=f"{op}-{dt}-{case.name}")
        for (op, dt, b) in keys
        for case in CASES.get(op, [])
        if registry.wants((b,), "channels_last") or not case.name.startswith("nhwc_")
        if not case.dtypes or dt in case.dtypes
        if not case.backends or b in case.backends
    ]


PARAMS = _params(CPU_KEYS)


def _rng(*parts: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(parts).encode()))


def _build(op: str, dt: str, case: Case) -> tuple[Inputs, dict]:
    ins, attrs = case.make(_rng(op, case.name), dt)
    while len(ins) > 1 and ins[-1] is None:  # the runtime passes no trailing absent inputs
        ins.pop()
    for i in case.const:
        if i < len(ins) and ins[i] is not None:
            ins[i] = np.ascontiguousarray(ins[i])
            ins[i].setflags(write=False)  # bundle weights are read-only mmap views
    return ins, attrs


# --- the kernel test --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_every_kernel_has_cases(backend: str):
    keys = CPU_KEYS if backend == "cpu" else CUDA_KEYS
    ops = {op for (op, _, _) in keys}
    assert keys, f"no {backend} kernels registered"
    missing = sorted(f"{op}/{dt}" for (op, dt, _) in keys if not CASES.get(op))
    assert not missing, f"{backend} kernels without test cases in tests/test_kernels.py: {missing}"
    assert not sorted(ops - set(TOL)), f"no tolerance for {sorted(ops - set(TOL))}"
    assert not sorted(ops - set(R.REFERENCE)), f"a {backend} kernel has no reference"
    for op, cases in CASES.items():
        names = [c.name for c in cases]
        assert len(names) == len(set(names)), f"duplicate case names for {op}"


def test_only_integer_product_kernels_take_int8_activations():
    # a linear node with xq computes with quantized activations (the reference rounds x
    # so): a kernel without that product must decline it, or it would compute another
    # function; the packager then binds the kernel that has it, or the reference
    xq_cases = [c for c in CASES["linear"] if "xq" in _build("linear", "i4", c)[1]]
    assert xq_cases
    for (op, dt, b), k in registry.KERNELS.items():
        if op != "linear" or b == "ref":
            continue
        for case in xq_cases:
            attrs = _build("linear", dt, case)[1]
            takes = (dt, b) in {(d, bk) for d in case.dtypes for bk in case.backends}
            assert k.accepts(attrs) == takes, (k.name, dt, case.name)


def test_every_op_has_a_definition_and_a_reference():
    from edgepack.kernels import ops

    assert set(ops.OPS) == set(R.REFERENCE), "kernels/ops.py and the reference disagree"
    for op, d in ops.OPS.items():
        assert set(d.optional) <= set(d.roles) and set(d.consts) <= set(d.roles), op


def test_cuda_covers_every_cpu_kernel():
    # Issue 6: the cuda backend runs every op/dtype the cpu backend does, except the ops
    # that only the cpu's own graph passes create (a cuda plan never has them).
    cpu = {(op, dt) for (op, dt, _) in CPU_KEYS}
    cuda = {(op, dt) for (op, dt, _) in CUDA_KEYS}
    cpu_only = {
        op
        for p, made in registry.PASS_OPS.items()
        if registry.wants(("cpu",), p) and not registry.wants(("cuda",), p)
        for op in made
    }
    assert cpu_only == {"conv_wino", "mbconv", "qconv", "qdwconv", "qmbconv"}
    assert {(op, dt) for op, dt in cpu if op not in cpu_only} <= cuda, sorted(cpu - cuda)
    assert not {op for op, _ in cuda} & cpu_only, "a cuda kernel no cuda plan can reach"


@pytest.mark.parametrize("op", layout.LAYOUT_OPS)
def test_only_the_layout_pass_backends_take_channels_last_nodes(op: str):
    # No backend adapts to another's plan: a backend that does not ask for the
    # channels-last pass declines every channels-last node (the packager then cannot
    # give it one), and takes the same node channels-first.
    cases = [c for c in CASES[op] if c.name.startswith("nhwc_")]
    assert cases
    for case in cases:
        _, attrs = _build(op, "f32", case)
        assert layout.is_nhwc(attrs), case.name
        for o, dt, b in registry.KERNELS:
            if o == op and b != "ref":
                k = registry.KERNELS[(o, dt, b)]
                assert k.accepts(attrs) == registry.wants((b,), "channels_last"), (k.name, case)
                assert k.accepts(layout.channels_first_attrs(attrs)), (k.name, case)


def test_only_the_panel_pass_backends_take_panel_linears():
    # as for channels-last nodes: weights in panels are the cpu backend's plan alone
    cases = [c for c in CASES["linear"] if c.name.startswith("panel_")]
    assert len(cases) >= 8
    for case in cases:
        _, attrs = _build("linear", "f32", case)
        for (o, dt, b), k in registry.KERNELS.items():
            if o == "linear" and b != "ref" and dt in case.dtypes:
                assert k.accepts(attrs) == registry.wants((b,), "panels"), (k.name, case.name)


class HostMem:
    """Buffers as the cpu runtime has them: NumPy arrays."""

    def full(self, n: int, value, dtype) -> np.ndarray:
        return np.full(n, value, dtype)

    def put(self, a: np.ndarray, const: bool) -> np.ndarray:
        return a

    def get(self, a) -> np.ndarray:
        return np.asarray(a)


class DevMem:
    """Buffers as the cuda runtime has them: device arrays from the cuda backend's
    ``dev`` (NumPy under the simulator, cupy on a GPU); weights uploaded once."""

    def __init__(self) -> None:
        from edgepack.kernels.cuda.device import dev

        self.d = dev()

    def full(self, n: int, value, dtype):
        xp = self.d.xp
        return xp.full(n, value, dtype)

    def put(self, a: np.ndarray, const: bool):
        if const:
            return self.d.upload(a)
        out = self.full(a.size, 0, a.dtype).reshape(a.shape)
        self.d.copy_in(out, a)
        return out

    def get(self, a) -> np.ndarray:
        out = np.empty(a.shape, a.dtype)
        self.d.copy_out(out, a)
        return out


def _poison(dtype) -> float | int:
    """What an output holds before a run: NaN, or for integer outputs (argmax's int64)
    a value no kernel writes."""
    kind = np.dtype(dtype).kind
    if kind == "u":
        return 251  # none of the cases' unsigned values (0..9)
    return np.nan if kind == "f" else False if kind == "b" else -7  # bool: the sentinel's not


def _guarded(mem, shape: tuple[int, ...], dtype=F32):
    """A poisoned output view with sentinel guard bands on both sides."""
    size = int(np.prod(shape, dtype=np.int64))
    buf = mem.full(size + 2 * GUARD, OUT_SENTINEL, dtype)
    buf[GUARD : GUARD + size] = _poison(dtype)
    return buf, buf[GUARD : GUARD + size].reshape(shape)


def _check_guards(mem, buf, sentinel, what: str) -> None:
    b = mem.get(buf)
    head, tail = b[:GUARD], b[-GUARD:]
    sentinel = np.asarray(sentinel).astype(b.dtype)  # a bool or integer output's sentinel
    assert (head == sentinel).all() and (tail == sentinel).all(), f"{what}: wrote out of bounds"


def _check_kernel(backend: str, mem, op: str, dt: str, case: Case, runs: int = 2) -> None:
    kernel = registry.KERNELS[(op, dt, backend)]
    ins, attrs = _build(op, dt, case)
    assert kernel.accepts(attrs), f"{kernel.name} refuses the case's attrs {attrs}"
    originals = [None if a is None else a.copy() for a in ins]
    ref_ins = [a.copy() if i in case.state else a for i, a in enumerate(ins)]
    want = _want(op, dt, ref_ins, attrs)  # the reference writes its copies of the state
    specs = _specs(op, dt, ins)
    ins = [None if a is None else mem.put(a, i in case.const) for i, a in enumerate(ins)]

    buf, out = _guarded(mem, want.shape, want.dtype)
    if case.inplace:  # the output takes over input 0's storage
        assert ins[0].size == want.size
        ins[0] = out.reshape(ins[0].shape)
        ins[0][...] = mem.put(originals[0], False)

    need = kernel.scratch(specs, [want.shape], attrs)
    assert need >= 0
    sbuf = mem.full(need + 2 * GUARD, SCRATCH_SENTINEL, np.uint8)
    scratch = sbuf[GUARD : GUARD + need]  # exactly what the plan would reserve

    step = kernel.bind(ins, [out], scratch, attrs)
    if step is None:
        assert case.inplace, f"{kernel.name} returned no step for a copy"
    rtol, atol = TOL[op]
    if want.dtype == np.uint8:  # codes: the float32 value they quantize may differ in
        rtol, atol = 0, 1  # its last bit, which moves a value on a .5 boundary one code
    # Run twice, re-poisoning before each run: the plan hands the same scratch bytes to
    # other nodes between two runs of this one, so nothing may be kept there from bind
    # or from the previous run; nor may a kernel rely on what its output held.
    for run in range(runs):
        if step is not None:
            scratch[...] = SCRATCH_SENTINEL
            if case.inplace:
                ins[0][...] = mem.put(originals[0], False)
            else:
                out[...] = _poison(want.dtype)
            step()
        np.testing.assert_allclose(
            mem.get(out),
            want,
            rtol=rtol,
            atol=atol,
            err_msg=f"{kernel.name} {case.name} dtype {dt}, run {run + 1}",
        )
        _check_guards(mem, buf, OUT_SENTINEL, f"{kernel.name} output")
        _check_guards(mem, sbuf, SCRATCH_SENTINEL, f"{kernel.name} scratch")
        for i, (a, a0) in enumerate(zip(ins, originals, strict=True)):
            if i in case.state:  # written as the reference writes it, bit for bit
                np.testing.assert_array_equal(mem.get(a), ref_ins[i], err_msg=f"state {i}")
            elif a is not None and not (case.inplace and i == 0):
                # bits, not values: a NaN input is unchanged though NaN != NaN
                same = np.asarray(mem.get(a)).tobytes() == np.asarray(a0).tobytes()
                assert same, f"{kernel.name} modified input {i}"


@pytest.mark.cpu
@pytest.mark.parametrize(("op", "dt", "case"), PARAMS)
def test_cpu_kernel(op: str, dt: str, case: Case) -> None:
    _check_kernel("cpu", HostMem(), op, dt, case)


_BAND_CASES = [
    c
    for c in CASES["conv"]
    if c.name
    in (
        "g1_k3_s1_p1",
        "g2_k3_s2_p1_res",
        "k7_s2_p3",
        "k3_asym_pads_s2",
        "batch2",
        "nhwc_g1_k3_s1_p1",
        "nhwc_k7_s2_p3",
        "nhwc_k3_asym_pads_s2",
    )
]


@pytest.mark.cpu
@pytest.mark.parametrize("dt", ["f32", "i8"])
@pytest.mark.parametrize("case", _BAND_CASES, ids=lambda c: c.name)
def test_cpu_conv_in_bands_of_rows(monkeypatch, dt: str, case: Case) -> None:
    """im2col + GEMM in bands of output rows (as big images run), the last band shorter:
    small band limits split the test images into bands of a few rows."""
    from edgepack.kernels.cpu import backend as backend_cpu

    monkeypatch.setattr(backend_cpu, "BAND_BYTES", 2600)
    monkeypatch.setattr(backend_cpu, "MIN_BAND_COLS", 4)
    assert backend_cpu._band_rows(36, 9, 9) == 2  # g1_k3_s1_p1: 4 bands of 2 rows + 1
    _check_kernel("cpu", HostMem(), "conv", dt, case)


_QMB_CASES = {c.name: c for c in CASES["qmbconv"]}
_MB_CASES = {c.name: c for c in CASES["mbconv"]}
_ROW_SHARE_CASES = [
    *(("qmbconv", _QMB_CASES[n]) for n in ("s1_band3", "s2_band2_odd_i8dw", "batch2_s2",
                                           "c6_ce20_co70_i8dw", "s2_three_rows_res")),
    *(("mbconv", _MB_CASES[n]) for n in ("s1_res_band2", "s2_10x11_band3", "no_expand_s2_clip",
                                         "batch2_res", "f16_all")),
]  # fmt: skip


@pytest.mark.cpu
@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize(("op", "case"), _ROW_SHARE_CASES, ids=lambda v: getattr(v, "name", v))
def test_cpu_chain_row_shares(monkeypatch, workers: int, op: str, case: Case) -> None:
    """The chains run in one region (qmbconv; mbconv's "rows" variant) at other thread
    counts than the machine's: each worker's share of the output rows in bands of its
    own (shares of 1-5 rows, shorter than a band, and none: 4 workers on 3 output
    rows), the float chain's expanded rows carried between its bands."""
    from edgepack.kernels.cpu import backend as backend_cpu

    monkeypatch.setattr(backend_cpu, "kernel_threads", lambda: workers)
    _check_kernel("cpu", HostMem(), op, "f32", case)


@pytest.mark.parametrize(
    ("name", "variant"),
    [("s1_res_band2", "rows"), ("no_expand_band4", "rows"), ("f16_dw", "rows"),
     ("f16_all", "rows"), ("i8_all", "rows"), ("bf16_all_no_expand", "rows"),
     ("k5_s2_band1", "bands"), ("mixed_i8_f32_i8", "bands")],
)  # fmt: skip
def test_mbconv_variant_by_window_and_weight_types(name: str, variant: str) -> None:
    """One region for 3x3 chains of one weight type (abi.MBCONV_ROWS_TYPES, fp16
    depthwise weights widened first); three kernels a band for other windows and mixes."""
    from edgepack.kernels.cpu import backend as backend_cpu

    ins, attrs = _MB_CASES[name].make(_rng("variant", name), "f32")
    specs = [None if t is None else (t.shape, wtypes.of_array(t)) for t in ins]
    y = (1, *ins[0].shape[1:3], 1)  # the variant depends on the weights alone
    assert backend_cpu._mbconv_variant(specs, [y], attrs) == variant


@pytest.mark.cuda
@pytest.mark.parametrize(("op", "dt", "case"), _params(CUDA_KEYS))
def test_cuda_kernel(op: str, dt: str, case: Case) -> None:
    # Under the simulator (the CPU-only default, see conftest.py) this checks the
    # kernels' logic; scripts/gpu_check.sh runs the same test on a real GPU.
    _check_kernel("cuda", DevMem(), op, dt, case)


def _all_stored_values(dt: str) -> np.ndarray:
    """Every finite float16 (63488 = 64 * 992 values), every finite bfloat16 as its bits
    (65280 = 64 * 1020), or every int8 (256 = 64 * 4)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if dt == "f16":
        h = bits.view(np.float16)
        return h[np.isfinite(h)]
    if dt == "bf16":
        return bits[np.isfinite(wtypes.bf16_to_f32(bits))]
    assert dt == "i8", dt
    return np.arange(-128, 128).astype(np.int8)


_DECODE = [
    pytest.param(b, op, dt, marks=getattr(pytest.mark, b), id=f"{b}-{op}-{dt}")
    for (op, dt, b) in CPU_KEYS + CUDA_KEYS
    if op in registry.WEIGHT_OPS and dt != "f32" and wtypes.get(dt).per_element == 1
    if op != "qconv"  # never decoded: it multiplies the stored integers (its own cases)
    # its output is u8 codes (a value each per 256 levels); it widens int8 weights with
    # the vloadw_n these cases check through dwconv's dw3
    if op != "qdwconv"
    # its output mixes U's elements through the output transform: the widening as U is
    # packed is checked value by value in test_gemm_tiles.py
    if op != "conv_wino"
]


@pytest.mark.parametrize(("backend", "op", "dt"), _DECODE)
def test_weight_decode_is_exact(backend: str, op: str, dt: str) -> None:
    """Weight decoding is exact for every value (subnormal halves, 65504, -128).

    The tolerance cases cannot see a wrong tiny weight; here a one-hot input makes each
    output element equal one stored weight (times an int8 scale of exactly 1).
    """
    kernel = registry.KERNELS[(op, dt, backend)]
    mem = HostMem() if backend == "cpu" else DevMem()
    vals = _all_stored_values(dt)
    k = 64
    n = vals.size // k
    none = {"act": "none", "act_args": [0.0, 0.0]}
    conv_attrs = {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1}
    as_f32 = wtypes.DEQUANTIZE[dt]
    if op == "linear":  # y[m, n] = w[n, m]
        w, x, attrs = vals.reshape(n, k), np.eye(k, dtype=F32), none
        want = as_f32(w, None).T
    elif op == "conv":  # 1x1 conv over an 8x8 image whose pixel p is one-hot in channel p
        w, x = vals.reshape(n, k, 1, 1), np.eye(k, dtype=F32).reshape(1, k, 8, 8)
        attrs = conv_attrs | none
        want = as_f32(w, None).reshape(1, n, 8, 8)
    elif op == "embed":  # every row looked up once: y = w
        w = vals.reshape(-1, k)
        x = np.arange(w.shape[0], dtype=np.int32)
        scale = np.ones(w.shape[0], F32) if dt == "i8" else None
        w.setflags(write=False)
        _run_exact(kernel, mem, op, dt, [x, w, scale], none, as_f32(w, None))
        return
    else:  # depthwise 1x1 over ones: y[c] = w[c]
        w, x = vals.reshape(-1, 1, 1, 1), np.ones((1, vals.size, 1, 1), F32)
        attrs = conv_attrs | none | {"group": vals.size}
        want = as_f32(w, None).reshape(x.shape)
    w.setflags(write=False)
    scale = np.ones(w.shape[0], F32) if dt == "i8" else None
    _run_exact(kernel, mem, op, dt, [x, w, None, scale], attrs, want)


def _run_exact(kernel, mem, op: str, dt: str, ins: list, attrs: dict, want: np.ndarray) -> None:
    specs = _specs(op, dt, ins)
    ins = [None if a is None else mem.put(a, i > 0) for i, a in enumerate(ins)]
    scratch = mem.full(kernel.scratch(specs, [want.shape], attrs), SCRATCH_SENTINEL, np.uint8)
    out = mem.full(want.size, np.nan, F32).reshape(want.shape)
    kernel.bind(ins, [out], scratch, attrs)()
    out = mem.get(out)
    bad = np.flatnonzero(out != want)  # float compare: -0 == 0 (sums drop the sign), NaN fails
    assert bad.size == 0, (
        f"{kernel.name}: {bad.size} decoded weights differ, e.g. stored "
        f"{want.reshape(-1)[bad[:5]]} came out {out.reshape(-1)[bad[:5]]}"
    )


def _int4_every_value(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed, fp16 scales, their float32 weights): one 32-weight group per row, row r
    scaled by the r-th of every ``step``-th finite half (subnormals, 65504, signed
    zeros) and holding every code -8..7 twice, rotated by r."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    scales = h[np.isfinite(h)][::step].reshape(-1, 1)
    n = scales.shape[0]
    codes = (np.arange(32)[None, :] + np.arange(n)[:, None]) % 16 - 8
    q = (codes + 8).reshape(n, 1, 2, 16)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(n, 16)
    want = codes.astype(F32) * scales.astype(F32)
    assert np.array_equal(wtypes.DEQUANTIZE["i4"](packed, scales), want)  # the layout
    return packed, scales, want


_DECODE_I4 = [
    pytest.param(b, op, marks=getattr(pytest.mark, b), id=f"{b}-{op}")
    for (op, dt, b) in CPU_KEYS + CUDA_KEYS
    if dt == "i4"
]


@pytest.mark.parametrize(("backend", "op"), _DECODE_I4)
def test_int4_decode_is_exact(backend: str, op: str) -> None:
    """int4 codes times every kind of fp16 scale come out exactly (one-hot inputs pick
    single weights), through the fused GEMV (linear, a few rows) and the decoders."""
    kernel = registry.KERNELS[(op, "i4", backend)]
    mem = HostMem() if backend == "cpu" else DevMem()
    packed, scales, want = _int4_every_value(1 if backend == "cpu" else 31)
    packed.setflags(write=False)
    n = packed.shape[0]
    none = {"act": "none", "act_args": [0.0, 0.0], "wshape": [n, 32]}
    if op == "linear":  # y[m, r] = w[r, j0 + m], 8 rows at a time
        for j0 in range(0, 32, 8):
            x = np.eye(32, dtype=F32)[j0 : j0 + 8]
            _run_exact(
                kernel, mem, op, "i4", [x, packed, None, scales], none, want[:, j0 : j0 + 8].T
            )
        return
    # a 1x1 conv over a 32-channel image whose pixel p is one-hot in channel p
    attrs = none | {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1}
    attrs["wshape"] = [n, 32, 1, 1]
    x = np.eye(32, dtype=F32).reshape(1, 32, 4, 8)
    _run_exact(kernel, mem, op, "i4", [x, packed, None, scales], attrs, want.reshape(1, n, 4, 8))


@pytest.mark.cpu
def test_cpu_pad_refuses_other_modes() -> None:
    # Reflect/edge pads have no cpu kernel; the packager must fall back to ref for them.
    k = registry.KERNELS[("pad", "f32", "cpu")]
    for mode in ("reflect", "edge"):
        assert not k.accepts({"pads": [0, 1, 0, 1], "mode": mode, "value": 0.0})
        backend, _ = registry.choose("pad", "f32", {"pads": [0, 1], "mode": mode}, ("cpu", "ref"))
        assert backend == "ref"


# --- the reference against ONNX Runtime ---------------------------------------------------

OPSET = 17


def _ort_run(node, feeds: dict[str, np.ndarray], inits: dict[str, np.ndarray]) -> np.ndarray:
    return _ort_graph([node], feeds, inits)


def _ort_graph(nodes, feeds: dict[str, np.ndarray], inits: dict[str, np.ndarray],
               opset: int = OPSET, out_type: int = 1) -> np.ndarray:  # fmt: skip
    """ORT's output of a graph of ``nodes`` (the last one's first output)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import helper, numpy_helper

    def vi(name, a):
        code = helper.np_dtype_to_tensor_dtype(a.dtype)
        return helper.make_tensor_value_info(name, code, list(a.shape))

    graph = helper.make_graph(
        nodes,
        "under_test",
        [vi(n, a) for n, a in feeds.items()],
        [helper.make_tensor_value_info(nodes[-1].output[0], out_type, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3  # ONNX shape inference and ORT disagree on some ceil_mode shapes
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _compare_ref(got_ref: np.ndarray, got_ort: np.ndarray, rtol: float, atol: float) -> None:
    assert got_ref.shape == got_ort.shape, f"shape: reference {got_ref.shape}, ORT {got_ort.shape}"
    np.testing.assert_allclose(got_ref, got_ort, rtol=rtol, atol=atol)


_ORT_CONV = [
    pytest.param(op, c, id=f"{op}-{c.name}")
    for op in ("conv", "dwconv")
    for c in CASES[op]
    # channels-last cases run the same reference on transposed copies: ORT checks the
    # channels-first one
    if not c.name.startswith(("act_", "nhwc_")) and "res" not in c.name
]


@pytest.mark.parametrize(("op", "case"), _ORT_CONV)
def test_reference_conv_matches_onnxruntime(op: str, case: Case) -> None:
    from onnx import helper

    ins, attrs = case.make(_rng("ort", op, case.name), "f32")
    x, w, b = ins[0], ins[1], ins[2]
    names = ["x", "w"] + (["b"] if b is not None else [])
    node = helper.make_node(
        "Conv",
        names,
        ["y"],
        kernel_shape=list(w.shape[2:]),
        strides=attrs["strides"],
        pads=attrs["pads"],
        dilations=attrs["dilations"],
        group=attrs["group"],
    )
    inits = {"w": w} | ({"b": b} if b is not None else {})
    _compare_ref(R.REFERENCE[op](ins, attrs), _ort_run(node, {"x": x}, inits), 1e-4, 1e-4)


@pytest.mark.parametrize(
    ("op", "case"),
    [
        pytest.param(op, c, id=f"{op}-{c.name}")
        for op in ("maxpool", "avgpool")
        for c in CASES[op]
        # ONNX Runtime's MaxPool keeps or drops a NaN by where it sits in the window;
        # the reference (and every edgepack kernel) keeps it
        if not c.name.startswith("nhwc_") and not (op == "maxpool" and c.name.startswith("ieee_"))
    ],
)
def test_reference_pool_matches_onnxruntime(op: str, case: Case) -> None:
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", op, case.name), "f32")
    extra = (
        {"dilations": attrs["dilations"]}
        if op == "maxpool"
        else {"count_include_pad": attrs["count_include_pad"]}
    )
    node = helper.make_node(
        "MaxPool" if op == "maxpool" else "AveragePool",
        ["x"],
        ["y"],
        kernel_shape=attrs["kernel"],
        strides=attrs["strides"],
        pads=attrs["pads"],
        ceil_mode=case.onnx["ceil_mode"],
        **extra,
    )
    _compare_ref(R.REFERENCE[op]([x], attrs), _ort_run(node, {"x": x}, {}), 1e-6, 1e-6)


@pytest.mark.parametrize(
    "case", [c for c in CASES["pool_nd"] if not c.name.startswith("ieee_")], ids=lambda c: c.name
)
def test_reference_pool_nd_matches_onnxruntime(case: Case) -> None:
    """MaxPool / AveragePool / LpPool over 1-3 spatial axes as ORT (ceil_mode where the
    case's ``out`` needs it)."""
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "pool_nd", case.name), "f32")
    op = {"max": "MaxPool", "avg": "AveragePool", "lp": "LpPool", "argmax": "MaxPool",
          "argmax_col": "MaxPool"}[attrs["kind"]]  # fmt: skip
    kw = {"count_include_pad": attrs["count_include_pad"]} if op == "AveragePool" else {}
    kw |= {"p": attrs["p"]} if op == "LpPool" else {}
    floor = [(x.shape[2 + i] + attrs["pads"][i] + attrs["pads"][i + len(attrs["kernel"])]
              - (attrs["kernel"][i] - 1) * attrs["dilations"][i] - 1) // attrs["strides"][i] + 1
             for i in range(len(attrs["kernel"]))]  # fmt: skip
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=attrs["kernel"],
                            strides=attrs["strides"], pads=attrs["pads"],
                            dilations=attrs["dilations"], ceil_mode=int(floor != attrs["out"]),
                            **kw)  # fmt: skip
    if attrs["kind"].startswith("argmax"):  # the Indices, MaxPool's second output
        from onnx import TensorProto

        node.output.append("i")
        if attrs["kind"] == "argmax_col":
            node.attribute.append(helper.make_attribute("storage_order", 1))
        pick = helper.make_node("Identity", ["i"], ["iy"])
        got = _ort_graph([node, pick], {"x": x}, {}, opset=19, out_type=TensorProto.INT64)
        np.testing.assert_array_equal(R.REFERENCE["pool_nd"]([x], attrs), got)
        return
    got = _ort_graph([node], {"x": x}, {}, opset=19)
    _compare_ref(R.REFERENCE["pool_nd"]([x], attrs), got, 1e-5, 1e-6)


@pytest.mark.parametrize(
    "case", [c for c in CASES["grid_sample"] if not c.name.startswith("ieee_")],
    ids=lambda c: c.name,
)  # fmt: skip
def test_reference_grid_sample_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (x, grid), attrs = case.make(_rng("ort", "grid_sample", case.name), "f32")
    node = helper.make_node("GridSample", ["x", "g"], ["y"], mode=attrs["mode"],
                            padding_mode=attrs["padding_mode"],
                            align_corners=attrs["align_corners"])  # fmt: skip
    got = _ort_graph([node], {"x": x, "g": grid}, {}, opset=20)
    _compare_ref(R.REFERENCE["grid_sample"]([x, grid], attrs), got, 1e-5, 1e-5)


@pytest.mark.parametrize("case", CASES["softmax"], ids=lambda c: c.name)
def test_reference_softmax_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "softmax", case.name), "f32")
    op = "LogSoftmax" if attrs.get("log") else "Softmax"
    node = helper.make_node(op, ["x"], ["y"], axis=attrs["axis"])
    atol = 1e-5 if attrs.get("log") else 1e-7  # log-softmax: values of order 1e4
    _compare_ref(R.softmax([x], attrs), _ort_run(node, {"x": x}, {}), 1e-5, atol)


@pytest.mark.parametrize("case", CASES["sdpa"], ids=lambda c: c.name)
def test_reference_sdpa_matches_onnxruntime(case: Case) -> None:
    """The chain an exporter writes (MatMul, Mul by the scale, Add of the mask, Softmax,
    MatMul) in ONNX Runtime against the fused op's reference."""
    from onnx import helper

    ins, attrs = case.make(_rng("ort", "sdpa", case.name), "f32")
    names = ["q", "k", "v", "mask"][: len(ins)]
    feeds = dict(zip(names, ins))
    kt = "k"
    nodes = []
    if not attrs["k_t"]:
        perm = [*range(ins[1].ndim - 2), ins[1].ndim - 1, ins[1].ndim - 2]
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=perm))
        kt = "kt"
    nodes += [helper.make_node("MatMul", ["q", kt], ["s0"]),
              helper.make_node("Mul", ["s0", "scale"], ["s1"])]  # fmt: skip
    last = "s1"
    if "mask" in feeds:
        nodes.append(helper.make_node("Add", ["s1", "mask"], ["s2"]))
        last = "s2"
    nodes.append(helper.make_node("Softmax", [last], ["p"], axis=-1))
    inits = {"scale": np.array(attrs["scale"], F32), "zero": np.array(0.0, F32)}
    if attrs.get("nan_zero"):  # torch's guard: Where(IsNaN(p), 0, p)
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", "p"], ["pz"])]  # fmt: skip
    nodes.append(helper.make_node("MatMul", ["pz" if attrs.get("nan_zero") else "p", "v"], ["y"]))
    want = _ort_graph(nodes, feeds, inits)
    _compare_ref(R.sdpa(ins, attrs), want, 1e-5, 1e-6)


_ONNX_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max",
                "min": "Min", "pow": "Pow", "mod": "Mod", "fmod": "Mod", "bit_and": "BitwiseAnd",
                "bit_or": "BitwiseOr", "bit_xor": "BitwiseXor"}  # fmt: skip
assert set(_ONNX_BINARY) == {*BINARY_KINDS, *INT_ONLY_KINDS}


@pytest.mark.parametrize(
    "case", [c for c in CASES["binary"] if "_relu" not in c.name and "clip" not in c.name
             and "sigmoid" not in c.name], ids=lambda c: c.name)  # fmt: skip
def test_reference_binary_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (a, b), attrs = case.make(_rng("ort", "binary", case.name), "f32")
    if attrs["act"] != "none":
        pytest.skip("ONNX has no fused activation")
    kw = {"fmod": int(attrs["kind"] == "fmod")} if attrs["kind"] in ("mod", "fmod") else {}
    node = helper.make_node(_ONNX_BINARY[attrs["kind"]], ["a", "b"], ["y"], **kw)
    ref = R.binary([a, b], attrs)
    got = _ort_graph(
        [node], {"a": a, "b": b}, {}, out_type=helper.np_dtype_to_tensor_dtype(ref.dtype),
        **({"opset": 18} if attrs["kind"].startswith("bit_") else {}),  # Bitwise*: opset 18
    )
    _compare_ref(ref, got, 1e-6, 1e-7)


@pytest.mark.parametrize("case", [c for c in CASES["rnn"] if not c.name.startswith("ieee_")],
                         ids=lambda c: c.name)  # fmt: skip
def test_reference_rnn_matches_onnxruntime(case: Case) -> None:
    """LSTM / GRU / RNN, one direction: every step's h (Y), or the last cell state (Y_c)."""
    from onnx import helper

    (x, w, r, b, h0, c0), attrs = case.make(_rng("ort", "rnn", case.name), "f32")
    cell = attrs["cell"]
    op = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}[cell]
    feeds = {"x": x, **({"h0": h0[None]} if h0 is not None else {}),
             **({"c0": c0[None]} if c0 is not None else {})}  # fmt: skip
    ins = ["x", "w", "r", "b", "", "h0" if h0 is not None else "", "c0" if c0 is not None else ""]
    kw = {"linear_before_reset": attrs["linear_before_reset"]} if cell == "gru" else {}
    emit_c, emit_hc = attrs["emit"] == "c", attrs["emit"] == "hc"
    n_in, n_out = (7, 3) if cell == "lstm" else (6, 2)
    direction = "reverse" if attrs["reverse"] else "forward"
    node = helper.make_node(op, ins[:n_in], ["y", "yh", "yc"][:n_out], hidden_size=r.shape[1],
                            direction=direction, **kw)  # fmt: skip
    pick = helper.make_node("Identity", ["yc" if emit_c else "y"], ["out"])
    inits = {"w": w[None], "r": r[None], "b": b[None]}
    got = _ort_graph([node, pick], feeds, inits, opset=14)
    ref = R.rnn([x, w, r, b, h0, c0], attrs)
    if emit_hc:  # each step's h, then the final cell state
        pick = helper.make_node("Identity", ["yc"], ["out"])
        c_last = _ort_graph([node, pick], feeds, inits, opset=14)
        got = np.concatenate([got[:, 0], c_last], axis=0)
    elif emit_c:  # ORT gives the final cell state only
        got, ref = got[0], ref[0 if attrs["reverse"] else -1]
    else:
        got = got[:, 0]
    _compare_ref(ref, got, 1e-5, 1e-6)


@pytest.mark.parametrize("case", [c for c in CASES["cumsum"] if not c.name.startswith("ieee_")],
                         ids=lambda c: c.name)  # fmt: skip
def test_reference_cumsum_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "cumsum", case.name), "f32")
    node = helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=attrs["exclusive"],
                            reverse=attrs["reverse"])  # fmt: skip
    got = _ort_graph([node], {"x": x}, {"axis": np.array(attrs["axis"], np.int64)},
                     out_type=helper.np_dtype_to_tensor_dtype(x.dtype))  # fmt: skip
    _compare_ref(R.cumsum([x], attrs), got, 1e-5, 1e-6)


# ONNX Runtime's TopK orders NaN by comparisons that are all false (no defined place):
# the specials cases are the kernels' only
@pytest.mark.parametrize(
    "case",
    [c for c in (*CASES["topk"], *CASES["gather_elements"]) if not c.name.startswith("ieee_")],
    ids=lambda c: c.name,
)
def test_reference_topk_gather_elements_match_onnxruntime(case: Case) -> None:
    """TopK's indices (and values, their gather_elements) and GatherElements as ORT."""
    from onnx import TensorProto, helper

    ins, attrs = case.make(_rng("ort", "topk", case.name), "f32")
    if "k" in attrs:
        node = helper.make_node("TopK", ["x", "k"], ["v", "y"], axis=attrs["axis"],
                                largest=attrs["largest"])  # fmt: skip
        k = np.array([attrs["k"]], np.int64)
        idx = helper.make_node("Identity", ["y"], ["i"])  # the indices, TopK's 2nd output
        got = _ort_graph([node, idx], {"x": ins[0]}, {"k": k}, out_type=TensorProto.INT64)
        ref = R.topk(ins, attrs)
    else:
        node = helper.make_node("GatherElements", ["x", "i"], ["y"], axis=attrs["axis"])
        got = _ort_graph([node], {"x": ins[0], "i": ins[1]}, {},
                         out_type=helper.np_dtype_to_tensor_dtype(ins[0].dtype))  # fmt: skip
        ref = R.gather_elements(ins, attrs)
    np.testing.assert_array_equal(ref, got)


@pytest.mark.parametrize(
    "case",
    [(op, c) for op in ("scatter_elements", "gather_nd", "scatter_nd") for c in CASES[op]
     if not c.name.startswith("ieee_")],
    ids=lambda oc: f"{oc[0]}-{oc[1].name}",
)  # fmt: skip
def test_reference_scatter_gather_nd_match_onnxruntime(case) -> None:
    """ScatterElements, GatherND and ScatterND as ORT (opset 18: every reduction)."""
    from onnx import helper

    op, c = case
    ins, attrs = c.make(_rng("ort", op, c.name), "f32")
    onnx_op = {"scatter_elements": "ScatterElements", "gather_nd": "GatherND",
               "scatter_nd": "ScatterND"}[op]  # fmt: skip
    names = ["x", "i", "u"][: len(ins)]
    kw = {k: v for k, v in attrs.items() if k != "reduction" or v != "none"}
    node = helper.make_node(onnx_op, names, ["y"], **kw)
    got = _ort_graph([node], dict(zip(names, ins)), {}, opset=18,
                     out_type=helper.np_dtype_to_tensor_dtype(ins[0].dtype))  # fmt: skip
    np.testing.assert_allclose(R.REFERENCE[op](ins, attrs), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES["reduce"], ids=lambda c: c.name)
def test_reference_reduce_matches_onnxruntime(case: Case) -> None:
    from edgepack.packager.onnx_import import REDUCE_OPS
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "reduce", case.name), "f32")
    if attrs["kind"] == "mean":
        op = "ReduceMean"
    else:
        op = next(o for o, (k, _) in REDUCE_OPS.items() if k == attrs["kind"])
    axes = np.array(attrs["axes"], np.int64)
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=attrs["keepdims"])
    got = _ort_graph([node], {"x": x}, {"axes": axes}, opset=18)
    _compare_ref(R.reduce([x], attrs), got, 1e-5, 1e-6)


# ONNX Runtime's ArgMax skips a NaN unless it comes first, where NumPy's (the reference)
# takes the first NaN: the specials case is the kernels' only
@pytest.mark.parametrize("case", [c for c in CASES["argmax"] if not c.name.startswith("ieee_")],
                         ids=lambda c: c.name)  # fmt: skip
def test_reference_argmax_matches_onnxruntime(case: Case) -> None:
    from onnx import TensorProto, helper

    (x,), attrs = case.make(_rng("ort", "argmax", case.name), "f32")
    node = helper.make_node("ArgMin" if attrs["min"] else "ArgMax", ["x"], ["y"],
                            axis=attrs["axis"], keepdims=attrs["keepdims"],
                            select_last_index=int(attrs["select_last"]))  # fmt: skip
    got = _ort_graph([node], {"x": x}, {}, out_type=TensorProto.INT64)
    want = R.argmax([x], attrs)
    assert want.dtype == got.dtype == np.int64 and np.array_equal(want, got)


def _onnx_math_node(fn: str, args):
    """The ONNX node the importer maps to math ``fn`` (onnx_import.MATH_OPS)."""
    from onnx import helper

    if fn == "gelu_tanh":
        return helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")
    op, params = next((op, p) for op, (f, p) in MATH_OPS.items() if f == fn)
    return helper.make_node(op, ["x"], ["y"], **{k: v for (k, _), v in zip(params, args)})


@pytest.mark.parametrize("case", CASES["math"], ids=lambda c: c.name)
def test_reference_math_matches_onnxruntime(case: Case) -> None:
    (x,), attrs = case.make(_rng("ort", "math", case.name), "f32")
    node = _onnx_math_node(attrs["fn"], attrs["args"])
    got = _ort_graph([node], {"x": x}, {}, opset=20)  # Gelu is opset 20
    # ORT evaluates in float32 (its own exp, erf, tanh...): a few ulps, and up to 2e-7
    # absolute where its GELU-tanh rounds; NaN and infinities where the reference has them
    _compare_ref(R.math_op([x], attrs), got, 2e-6, 5e-7)


@pytest.mark.parametrize("case", CASES["reduce_mean"], ids=lambda c: c.name)
def test_reference_reduce_mean_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "reduce_mean", case.name), "f32")
    node = helper.make_node(
        "ReduceMean", ["x"], ["y"], axes=attrs["axes"], keepdims=attrs["keepdims"]
    )  # opset 17: axes is an attribute
    _compare_ref(R.reduce_mean([x], attrs), _ort_run(node, {"x": x}, {}), 1e-5, 1e-6)


_PAD_ORT = [
    *CASES["pad"],
    shape_case("reflect", [(1, 2, 4, 5)], {"pads": [0, 0, 2, 1, 0, 0, 1, 3], "mode": "reflect"}),
    shape_case("edge", [(1, 2, 4, 5)], {"pads": [0, 1, 2, 0, 0, 0, 1, 3], "mode": "edge"}),
]


@pytest.mark.parametrize("case", _PAD_ORT, ids=lambda c: c.name)
def test_reference_pad_matches_onnxruntime(case: Case) -> None:
    from onnx import helper

    (x,), attrs = case.make(_rng("ort", "pad", case.name), "f32")
    names = ["x", "pads"]
    inits = {"pads": np.asarray(attrs["pads"], np.int64)}
    if attrs["mode"] == "constant":
        names.append("value")
        inits["value"] = np.asarray(attrs["value"], F32)
    node = helper.make_node("Pad", names, ["y"], mode=attrs["mode"])
    _compare_ref(R.pad([x], attrs), _ort_run(node, {"x": x}, inits), 0.0, 0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("case", _PAD_ORT[-2:], ids=lambda c: c.name)
def test_cuda_pad_reflect_and_edge(case: Case) -> None:
    # The cuda backend takes every Pad mode (the cpu backend leaves these to ref).
    assert (
        registry.choose("pad", "f32", case.make(_rng("pad", case.name), "f32")[1], ("cuda", "ref"))[
            0
        ]
        == "cuda"
    )
    _check_kernel("cuda", DevMem(), "pad", "f32", case)


_ONNX_ACT = {"none": None, "relu": "Relu", "hard_swish": "HardSwish", "clip": "Clip"}


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES["mbconv"]
        if c.name in ("s1_res_band2", "k5_s1_res_band4", "no_expand_s2_clip")
    ],
    ids=lambda c: c.name,
)
def test_reference_mbconv_matches_onnxruntime(case: Case) -> None:
    """The fused chain's reference against ORT running the three Conv nodes (channels
    first, activations as their own nodes, the residual as an Add)."""
    from onnx import helper

    ins, attrs = case.make(_rng("ort", "mbconv", case.name), "f32")
    nodes, inits, cur = [], {}, "x"
    convs = [("expand", 1), ("dw", 4), ("project", 7)]
    for tag, i in convs:
        if ins[i] is None:
            continue
        sub = attrs[tag]
        w = np.ascontiguousarray(layout.hwio_weights(ins[i], sub).transpose(layout.OIHW_FROM_HWIO))
        inits[f"w_{tag}"], inits[f"b_{tag}"] = w, ins[i + 1]
        nodes.append(
            helper.make_node(
                "Conv",
                [cur, f"w_{tag}", f"b_{tag}"],
                [f"{tag}_conv"],
                kernel_shape=list(w.shape[2:]),
                strides=sub["strides"],
                pads=sub["pads"],
                group=sub["group"],
            )
        )
        cur = f"{tag}_conv"
        act = _ONNX_ACT[sub["act"]]
        if act == "Clip":
            lo, hi = sub["act_args"]
            inits[f"lo_{tag}"], inits[f"hi_{tag}"] = np.float32(lo), np.float32(hi)
            nodes.append(helper.make_node("Clip", [cur, f"lo_{tag}", f"hi_{tag}"], [f"{tag}_act"]))
            cur = f"{tag}_act"
        elif act:
            nodes.append(helper.make_node(act, [cur], [f"{tag}_act"]))
            cur = f"{tag}_act"
    feeds = {"x": np.ascontiguousarray(ins[0].transpose(layout.TO_NCHW))}
    if ins[10] is not None:
        feeds["r"] = np.ascontiguousarray(ins[10].transpose(layout.TO_NCHW))
        nodes.append(helper.make_node("Add", [cur, "r"], ["with_res"]))
        cur = "with_res"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    got_ort = _ort_graph(nodes, feeds, inits).transpose(layout.TO_NHWC)
    _compare_ref(R.REFERENCE["mbconv"](ins, attrs), got_ort, 1e-4, 1e-4)


@pytest.mark.cpu
def test_kv_cache_halves_round_as_numpy_casts():
    # fp16 KV caches store keys and values rounded by kernels/cpu/llm.py's bit routine:
    # the same half as NumPy's cast for random floats, every half, every midpoint
    # between neighbouring halves (ties to even), overflow and underflow edges.
    from edgepack.kernels.cpu.native import K

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(F32))
    mids = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(F32)  # exact in float32
    rng = np.random.default_rng(5)
    edges = np.array([65504.0, 65519.99, 65520.0, 1e9, 2.0**-24, 2.0**-25, 2.0**-26, 1e-30,
                      np.inf, -np.inf], F32)  # fmt: skip
    vals = np.concatenate([h, mids, -mids, edges, rng.standard_normal(200_000).astype(F32),
                           rng.integers(0, 2**32, 200_000, dtype=np.uint32).view(F32)])  # fmt: skip
    out = np.empty(vals.size, np.uint16)
    K.halves_from_f32(vals.view(np.uint32), out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = vals.astype(np.float16)
    got = out.view(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


@pytest.mark.cpu
def test_llm_kernels_refuse_indices_outside_their_tables():
    # An id, position or slot past a table would read or write outside the arena: the
    # cpu kernels raise instead (the session API checks first; `run` does not).
    ins, attrs = _build("embed", "f32", CASES["embed"][0])
    ins[0] = ins[0].copy()
    ins[0][1] = ins[1].shape[0]
    with pytest.raises(IndexError, match="token id"):
        registry.KERNELS[("embed", "f32", "cpu")].bind(ins, [np.zeros((7, 24), F32)], None, attrs)()
    ins, attrs = _build("rope", "f32", CASES["rope"][0])
    ins[1] = np.full_like(ins[1], ins[2].shape[0])
    with pytest.raises(IndexError, match="RoPE tables"):
        registry.KERNELS[("rope", "f32", "cpu")].bind(ins, [ins[0].copy()], None, attrs)()
    ins, attrs = _build("attention", "f32", CASES["attention"][2])
    kern = registry.KERNELS[("attention", "f32", "cpu")]
    scratch = np.zeros(kern.scratch(_specs("attention", "f32", ins), [(3, 96)], attrs), np.uint8)
    before = ins[3].copy()
    ins[1] = ins[1].copy()
    ins[1][2] = ins[3].shape[1]  # the last row's position is past the cache
    with pytest.raises(IndexError, match="KV cache"):
        kern.bind(ins, [np.zeros((3, 96), F32)], scratch, attrs)()
    np.testing.assert_array_equal(ins[3], before)  # nothing stored for any row
