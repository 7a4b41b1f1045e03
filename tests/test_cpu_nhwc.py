"""Channels-last CPU kernels (kernels/cpu/nhwc.py) against the NumPy reference.

The reference runs on NCHW data; inputs are transposed to NHWC for the kernel and
its output transposed back. Each buffer the kernel sees sits inside a larger one
whose guard bands hold NaN (inputs: a stray read shows up as a NaN in the output) or
a sentinel (outputs: a stray write changes it); outputs start as NaN so a pixel the
kernel skips is caught. Weights, bias and scale are read-only, as in a bundle.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from edgepack.kernels.activations import ACTIVATIONS
from edgepack.kernels.cpu.native import gemm_shape
from edgepack.kernels.flags import HAS_BIAS, HAS_RES, HAS_SCALE
from edgepack.kernels.ref import reference as R

pytestmark = pytest.mark.cpu

N = pytest.importorskip("edgepack.kernels.cpu.nhwc")

F32 = np.float32
GUARD = 64  # elements of guard band on each side of a buffer
OUT_SENTINEL = F32(-12345.0)
DW_TOL = (1e-4, 1e-4)  # tests/test_kernels.py TOL["dwconv"]: float32 sums vs float64
ACT_ARGS = {"none": (0.0, 0.0), "relu": (0.0, 0.0), "clip": (0.0, 6.0)}
ACT_ARGS |= {"leaky_relu": (0.1, 0.0), "hard_swish": (0.0, 0.0), "sigmoid": (0.0, 0.0),
            "silu": (0.0, 0.0)}


def _guarded(a: np.ndarray, fill: float) -> np.ndarray:
    """A C-contiguous copy of ``a`` inside a buffer with ``fill`` on both sides."""
    buf = np.full(a.size + 2 * GUARD, fill, a.dtype)
    view = buf[GUARD : GUARD + a.size].reshape(a.shape)
    view[...] = a
    return view


def _out(shape: tuple[int, ...]) -> np.ndarray:
    buf = np.full(int(np.prod(shape)) + 2 * GUARD, OUT_SENTINEL, F32)
    out = buf[GUARD : GUARD + int(np.prod(shape))].reshape(shape)
    out[...] = np.nan
    return out


def _check_guards(out: np.ndarray) -> None:
    buf = out.base
    while buf.base is not None:
        buf = buf.base
    assert (buf[:GUARD] == OUT_SENTINEL).all(), "kernel wrote before its output"
    assert (buf[-GUARD:] == OUT_SENTINEL).all(), "kernel wrote past its output"


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 (axis 0), as packager/quantize.py stores weights."""
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1).astype(np.float64)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    q = np.clip(np.rint(w / scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
    return q, scale.astype(F32)


def _out_side(n: int, k: int, s: int, p0: int, p1: int, d: int, ceil: bool = False) -> int:
    span = n + p0 + p1 - d * (k - 1) - 1
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= n + p0:  # ONNX drops a last window starting in the pad
        out -= 1
    return out


def _rng(cfg: dict) -> np.random.Generator:
    """A fixed seed per case (str hashes change between runs; crc32 does not)."""
    return np.random.default_rng(zlib.crc32(repr(sorted(cfg.items())).encode()))


# --- depthwise conv -------------------------------------------------------------------


def dw(name, c=8, hw=(9, 9), k=(3, 3), s=(1, 1), p=(1, 1, 1, 1), d=(1, 1), bias=True,
       res=False, act="none", wdt="f32", scale=False):  # fmt: skip
    """A depthwise case; ``scale`` gives float32 weights a per-channel scale too (int8
    weights always have one)."""
    cfg = dict(c=c, hw=hw, k=k, s=s, p=p, d=d, bias=bias, res=res, act=act, wdt=wdt)
    return pytest.param(cfg | {"scale": scale or wdt == "i8"}, id=name)


DW_CASES = [
    dw("k3_s1_p1"),
    dw("k3_s1_p1_c37_15x15_relu", c=37, hw=(15, 15), act="relu"),
    dw("k3_s1_p1_c32_56x56_clip", c=32, hw=(56, 56), act="clip"),
    dw("k3_s1_p1_c144_7x7_clip", c=144, hw=(7, 7), act="clip"),
    dw("k3_s1_p1_c16_res_clip", c=16, hw=(12, 11), res=True, act="clip"),
    dw("k3_s2_p1", s=(2, 2)),
    dw("k3_s2_p1_even_c37", c=37, hw=(14, 16), s=(2, 2), act="relu"),
    dw("k3_s2_p1_c96_56x56_clip", c=96, hw=(56, 56), s=(2, 2), act="clip"),
    dw("k3_s2_p1_res", c=24, hw=(15, 15), s=(2, 2), res=True),
    # 16 and 32 channels at column dilation 1 take rows compiled for that count
    dw("k3_s2_p1_c32_scale_res_clip", c=32, hw=(15, 14), s=(2, 2), scale=True, res=True),
    dw("k3_dil21_c16", c=16, d=(2, 1), p=(2, 1, 2, 1), hw=(11, 10), act="relu"),
    dw("k3_dil12_c32", c=32, d=(1, 2), p=(1, 2, 1, 2), hw=(10, 11), act="clip"),
    dw("k3_s1_c16_nobias_scale", c=16, hw=(9, 9), bias=False, scale=True),
    dw("k5_s2_p2", c=12, k=(5, 5), s=(2, 2), p=(2, 2, 2, 2), hw=(17, 23)),
    dw("k5_s1_p2_c37_relu", c=37, k=(5, 5), p=(2, 2, 2, 2), hw=(15, 15), act="relu"),
    dw("k1_s1_p0", c=37, k=(1, 1), p=(0, 0, 0, 0), hw=(7, 7), act="clip"),
    dw("k1_s2_p0_res", c=20, k=(1, 1), s=(2, 2), p=(0, 0, 0, 0), hw=(9, 8), res=True),
    dw("k3_dil2_p2", c=10, d=(2, 2), p=(2, 2, 2, 2), hw=(15, 15)),
    dw("k3_dil2_s2_p2_c37", c=37, d=(2, 2), s=(2, 2), p=(2, 2, 2, 2), hw=(15, 13), act="relu"),
    dw("k5_dil2_s2_p4", c=6, k=(5, 5), d=(2, 2), s=(2, 2), p=(4, 4, 4, 4), hw=(13, 12)),
    dw("k3_s21", c=9, s=(2, 1), hw=(10, 9)),
    dw("k3_s3_nopad", c=9, s=(3, 3), p=(0, 0, 0, 0), hw=(10, 11)),
    dw("k3_asym_pads", c=9, p=(0, 2, 1, 0), act="clip"),
    dw("k3_pads_gt_half", c=9, p=(2, 3, 2, 3), hw=(5, 6)),
    dw("k3_nopad_narrow", c=5, p=(0, 0, 0, 0), hw=(4, 3)),
    dw("k3_image_2x2", c=17, hw=(2, 2)),
    dw("k3_image_1x1", c=3, hw=(1, 1), act="relu"),
    dw("k3_c1", c=1, hw=(7, 7), act="clip"),
    dw("nobias", c=16, bias=False),
    dw("nobias_res_relu", c=16, bias=False, res=True, act="relu"),
    dw("f32_scale", c=16, scale=True, act="clip"),
    dw("f32_scale_nobias_res", c=16, scale=True, bias=False, res=True),
    dw("f32_scale_res_clip", c=37, hw=(7, 7), scale=True, res=True, act="clip"),
    *[dw(f"act_{a}", c=11, hw=(8, 7), act=a) for a in ACT_ARGS],
    *[dw(f"act_{a}_s2", c=11, hw=(8, 7), s=(2, 2), act=a) for a in ("leaky_relu", "hard_swish")],
    dw("i8_k3_s1_c37_15x15_clip", c=37, hw=(15, 15), wdt="i8", act="clip"),
    dw("i8_k3_s1_c32_56x56_relu", c=32, hw=(56, 56), wdt="i8", act="relu"),
    dw("i8_k3_s2_c24_res", c=24, hw=(15, 15), s=(2, 2), wdt="i8", res=True),
    dw("i8_k3_s1_nobias_res_clip", c=16, wdt="i8", bias=False, res=True, act="clip"),
    dw("i8_k3_s1_nobias", c=16, wdt="i8", bias=False),
    dw("i8_k5_s2_p2", c=12, k=(5, 5), s=(2, 2), p=(2, 2, 2, 2), hw=(17, 23), wdt="i8"),
    dw("i8_k1", c=37, k=(1, 1), p=(0, 0, 0, 0), hw=(7, 7), wdt="i8", act="relu"),
    dw("i8_k3_dil2", c=10, d=(2, 2), p=(2, 2, 2, 2), hw=(15, 15), wdt="i8", act="hard_swish"),
]


def _dw_inputs(cfg: dict, rng: np.random.Generator):
    c, (h, wd), (kh, kw) = cfg["c"], cfg["hw"], cfg["k"]
    (sh, sw), (pt, pl, pb, pr), (dh, dw_) = cfg["s"], cfg["p"], cfg["d"]
    oh, ow = _out_side(h, kh, sh, pt, pb, dh), _out_side(wd, kw, sw, pl, pr, dw_)
    x = rng.standard_normal((1, c, h, wd)).astype(F32)
    w = (rng.standard_normal((c, 1, kh, kw)) / np.sqrt(kh * kw)).astype(F32)
    scale = None
    if cfg["wdt"] == "i8":
        w, scale = _quantize(w)
    elif cfg["scale"]:
        scale = rng.uniform(0.5, 2.0, c).astype(F32)
    bias = (rng.standard_normal(c) * 0.5).astype(F32) if cfg["bias"] else None
    res = rng.standard_normal((1, c, oh, ow)).astype(F32) if cfg["res"] else None
    attrs = {
        "strides": list(cfg["s"]),
        "pads": list(cfg["p"]),
        "dilations": list(cfg["d"]),
        "group": c,
        "act": cfg["act"],
        "act_args": list(ACT_ARGS[cfg["act"]]),
    }
    return x, w, bias, scale, res, attrs, (oh, ow)


def _dw3(shape: str):
    from edgepack.kernels.cpu import gemm_tiles

    return getattr(gemm_tiles, f"dw3_{shape}")


# The row-wise kernel (any window), and the 3x3 one in explicit vectors at the host's
# width and at the narrowest (another lane count splits the channels differently).
DW_KERNELS = {
    "rows": lambda: N.dwconv_nhwc,
    **{f"dw3_{s}": (lambda s=s: _dw3(s)) for s in sorted({gemm_shape(), "4x2"})},
}


def _run_dw(x, w, bias, scale, res, attrs, out_hw, kernel: str = "rows") -> np.ndarray:
    """The NHWC kernel on the NCHW case; returns its output as NCHW."""
    c = x.shape[1]
    xt = _guarded(x[0].transpose(1, 2, 0), np.nan)
    wt = _readonly(w.transpose(2, 3, 1, 0))  # [kh, kw, 1, C]
    flags = (HAS_BIAS if bias is not None else 0) | (HAS_SCALE if scale is not None else 0)
    flags |= HAS_RES if res is not None else 0
    b_ = _readonly(bias if bias is not None else np.zeros(1, F32))
    s_ = _readonly(scale if scale is not None else np.zeros(1, F32))
    r_ = np.zeros((1, 1, 1), F32) if res is None else _guarded(res[0].transpose(1, 2, 0), np.nan)
    out = _out((*out_hw, c))
    a, b = (F32(v) for v in attrs["act_args"])
    sh, sw = attrs["strides"]
    pt, pl = attrs["pads"][:2]
    dh, dw_ = attrs["dilations"]
    act = ACTIVATIONS[attrs["act"]]
    kern = DW_KERNELS[kernel]()
    kern(xt, wt, b_, s_, r_, out, sh, sw, pt, pl, dh, dw_, flags, act, a, b)
    _check_guards(out)
    first = out.copy()
    kern(xt, wt, b_, s_, r_, out, sh, sw, pt, pl, dh, dw_, flags, act, a, b)
    np.testing.assert_array_equal(out, first, err_msg="a second run gave other bits")
    return out.transpose(2, 0, 1)[None]


@pytest.mark.parametrize("kernel", DW_KERNELS)
@pytest.mark.parametrize("cfg", DW_CASES)
def test_dwconv_nhwc(cfg: dict, kernel: str) -> None:
    if kernel != "rows" and cfg["k"] != (3, 3):
        pytest.skip("dw3 takes 3x3 windows (backend_cpu gives others to the row kernel)")
    x, w, bias, scale, res, attrs, out_hw = _dw_inputs(cfg, _rng(cfg))
    got = _run_dw(x, w, bias, scale, res, attrs, out_hw, kernel)
    want = R.REFERENCE["dwconv"]([x, w, bias, scale, res], attrs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=DW_TOL[0], atol=DW_TOL[1])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the reference's inf - inf
@pytest.mark.parametrize("kernel", DW_KERNELS)
def test_dwconv_nhwc_padding_is_zero_not_a_product(kernel: str) -> None:
    """Taps outside the image read a clamped pixel and discard it (a select): an inf
    at the image edge must not turn the padded taps of its neighbours into NaN."""
    cfg = dict(c=19, hw=(6, 7), k=(3, 3), s=(1, 1), p=(1, 1, 1, 1), d=(1, 1), bias=True)
    cfg |= dict(res=False, act="none", wdt="f32", scale=False)
    x, w, bias, scale, res, attrs, out_hw = _dw_inputs(cfg, np.random.default_rng(7))
    x[0, :, 0, :] = np.inf  # top row
    x[0, :, :, -1] = -np.inf  # right column
    got = _run_dw(x, w, bias, scale, res, attrs, out_hw, kernel)
    want = R.REFERENCE["dwconv"]([x, w, bias, scale, res], attrs)
    # where the reference is finite the kernel must be too (rows far from the infs)
    finite = np.isfinite(want)
    assert finite.any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=DW_TOL[0], atol=DW_TOL[1])
    np.testing.assert_array_equal(got[~finite], want[~finite])


def test_dwconv_nhwc_aot_types() -> None:
    """The JIT specialisations have the argument types an AOT build would export
    (cpu_abi's dwconv signature, weights [kh, kw, 1, C] of either dtype)."""
    from numba import types as T

    rng = np.random.default_rng(3)
    for wdt in ("f32", "i8"):
        cfg = dict(c=16, hw=(6, 6), k=(3, 3), s=(1, 1), p=(1, 1, 1, 1), d=(1, 1), bias=True)
        cfg |= dict(res=True, act="relu", wdt=wdt, scale=wdt == "i8")
        _run_dw(*_dw_inputs(cfg, rng))
    f3 = T.Array(T.float32, 3, "C")
    w1 = T.Array(T.float32, 1, "C", readonly=True)
    for wt in (T.float32, T.int8):
        sig = (f3, T.Array(wt, 4, "C", readonly=True), w1, w1, f3, f3)
        sig += (T.int64,) * 8 + (T.float32,) * 2
        assert sig in N.dwconv_nhwc.signatures, f"no specialisation for {sig}"


# --- max pool -------------------------------------------------------------------------


def mp(name, c=8, hw=(9, 9), k=(3, 3), s=(2, 2), p=(1, 1, 1, 1), d=(1, 1), ceil=False):
    return pytest.param(dict(c=c, hw=hw, k=k, s=s, p=p, d=d, ceil=ceil), id=name)


MP_CASES = [
    mp("k3_s2_p1"),
    mp("k3_s2_p1_c37_56x56", c=37, hw=(56, 56)),
    mp("k3_s2_p1_c64_15x15", c=64, hw=(15, 15)),
    mp("k2_s2_p0", k=(2, 2), p=(0, 0, 0, 0), hw=(8, 8)),
    mp("k2_s2_p0_c37_odd", c=37, k=(2, 2), p=(0, 0, 0, 0), hw=(7, 9)),
    mp("k3_s1_p1_c37_7x7", c=37, s=(1, 1), hw=(7, 7)),
    mp("k3_s2_p0_ceil", c=5, p=(0, 0, 0, 0), hw=(8, 8), ceil=True),
    mp("k3_s2_p1_ceil_c37", c=37, hw=(10, 10), ceil=True),
    mp("k3_dil2_s1_p2", c=6, s=(1, 1), d=(2, 2), p=(2, 2, 2, 2), hw=(11, 10)),
    mp("k5_s1_p2", c=7, k=(5, 5), s=(1, 1), p=(2, 2, 2, 2), hw=(9, 8)),
    mp("k3_asym_pads", c=7, s=(1, 1), p=(0, 1, 2, 0), hw=(6, 7)),
    mp("k3_image_1x1", c=3, s=(1, 1), hw=(1, 1)),
]


@pytest.mark.parametrize("cfg", MP_CASES)
def test_maxpool_nhwc(cfg: dict) -> None:
    rng = _rng(cfg)
    c, (h, wd), (kh, kw) = cfg["c"], cfg["hw"], cfg["k"]
    (sh, sw), (pt, pl, pb, pr), (dh, dw_) = cfg["s"], cfg["p"], cfg["d"]
    oh = _out_side(h, kh, sh, pt, pb, dh, cfg["ceil"])
    ow = _out_side(wd, kw, sw, pl, pr, dw_, cfg["ceil"])
    x = rng.standard_normal((1, c, h, wd)).astype(F32)
    attrs = {
        "kernel": [kh, kw],
        "strides": [sh, sw],
        "pads": [pt, pl, pb, pr],
        "dilations": [dh, dw_],
        "out_hw": [oh, ow],
    }
    want = R.REFERENCE["maxpool"]([x], attrs)
    xt = _guarded(x[0].transpose(1, 2, 0), np.nan)
    out = _out((oh, ow, c))
    N.maxpool_nhwc(xt, out, kh, kw, sh, sw, pt, pl, dh, dw_)
    _check_guards(out)
    np.testing.assert_array_equal(out.transpose(2, 0, 1)[None], want)


# --- global average pool --------------------------------------------------------------


@pytest.mark.parametrize(("c", "hw"), [(8, (7, 7)), (37, (15, 15)), (1280, (7, 7)), (5, (1, 1))])
def test_global_avgpool_nhwc(c: int, hw: tuple[int, int]) -> None:
    rng = np.random.default_rng(c * 1000 + hw[0])
    x = rng.standard_normal((1, c, *hw)).astype(F32)
    want = R.REFERENCE["global_avgpool"]([x], {})
    xt = _guarded(x[0].transpose(1, 2, 0).reshape(hw[0] * hw[1], c), np.nan)
    out = _out((c,))
    N.global_avgpool_nhwc(xt, out)
    _check_guards(out)
    np.testing.assert_allclose(out.reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    # the same sums in the same order as the planar kernel: the same bits
    from edgepack.kernels.cpu import kernels as K

    planar = np.empty(c, F32)
    K.global_avgpool(np.ascontiguousarray(x.reshape(c, -1)), planar)
    np.testing.assert_array_equal(out, planar)
