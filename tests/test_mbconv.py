"""The packager's chain fusion (packager/mbconv.py): which pointwise -> depthwise ->
pointwise chains become one ``mbconv`` node, and that the bundle still computes what
ONNX Runtime does, in every quantization mode (kernels are checked one by one in
test_kernels.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import load, ort_run, pack
from edgepack.packager import mbconv
from onnx import helper
from test_onnx_import import model, rand

pytestmark = pytest.mark.cpu


def _conv(name, x, w, y, **kw):
    return helper.make_node("Conv", [x, w, f"b_{w}"], [y], name=name, **kw)


def _clip(name, x, y):
    return helper.make_node("Clip", [x, "lo", "hi"], [y], name=name)


def _net():
    """Blocks A-E:
    A: expand 8->24, depthwise, project 24->8 + the block's input (residual): fuses;
    B: expand 8->24 whose output is also a graph output: the chain starts at its
       depthwise conv (no expand);
    C: depthwise stride 2 straight on B's projection, project 8->12: fuses without an
       expand (B's projection is not also C's expand);
    D: the depthwise output is also pooled (two readers): stays three nodes;
    E: expand, 5x5 depthwise stride 2, project: fuses.
    """
    c, e = 8, 24
    nodes = [
        _conv("a_exp", "x", "wa0", "a0"),
        _clip("a_clip0", "a0", "a1"),
        _conv("a_dw", "a1", "wa1", "a2", group=e, pads=[1, 1, 1, 1]),
        _clip("a_clip1", "a2", "a3"),
        _conv("a_proj", "a3", "wa2", "a4"),
        helper.make_node("Add", ["a4", "x"], ["a5"], name="a_add"),
        _conv("b_exp", "a5", "wb0", "b0"),
        helper.make_node("Relu", ["b0"], ["b_out"], name="b_relu"),
        _conv("b_dw", "b_out", "wb1", "b2", group=e, pads=[1, 1, 1, 1]),
        _conv("b_proj", "b2", "wb2", "b3"),
        _conv("c_dw", "b3", "wc1", "c2", group=c, pads=[1, 1, 1, 1], strides=[2, 2]),
        _conv("c_proj", "c2", "wc2", "c3"),
        _conv("d_exp", "c3", "wd0", "d0"),
        _conv("d_dw", "d0", "wd1", "d1", group=36, pads=[1, 1, 1, 1]),
        _conv("d_proj", "d1", "wd2", "d2"),
        helper.make_node("GlobalAveragePool", ["d1"], ["d_pool"], name="d_pool"),
        _conv("e_exp", "d2", "we0", "e0"),
        _clip("e_clip0", "e0", "e1"),
        _conv("e_dw", "e1", "we1", "e2", group=36, pads=[2, 2, 2, 2], strides=[2, 2]),
        _conv("e_proj", "e2", "we2", "y"),
    ]
    shapes = {
        "wa0": (e, c, 1, 1),
        "wa1": (e, 1, 3, 3),
        "wa2": (c, e, 1, 1),
        "wb0": (e, c, 1, 1),
        "wb1": (e, 1, 3, 3),
        "wb2": (c, e, 1, 1),
        "wc1": (c, 1, 3, 3),
        "wc2": (12, c, 1, 1),
        "wd0": (36, 12, 1, 1),
        "wd1": (36, 1, 3, 3),
        "wd2": (12, 36, 1, 1),
        "we0": (36, 12, 1, 1),
        "we1": (36, 1, 5, 5),
        "we2": (10, 36, 1, 1),
    }
    inits = {"lo": np.float32(0.0), "hi": np.float32(6.0)}
    for w, s in shapes.items():
        inits[w] = rand(*s) * np.float32(0.5)
        inits[f"b_{w}"] = rand(s[0]) * np.float32(0.1)
    return model(nodes, [("x", [1, c, 14, 13])], ["y", "b_out", "d_pool"], inits)


def _check(tmp_path, m: onnx.ModelProto, quant: str = "fp32", tol: float = 1e-4) -> list[dict]:
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    feeds = {"x": rand(1, 8, 14, 13)}
    refs = ort_run(path, feeds)
    sess = load(pack(path, tmp_path / f"m-{quant}.epk", quant=quant))
    got = sess.run(feeds)
    for o, ref in zip(m.graph.output, refs):
        err = np.linalg.norm(got[o.name] - ref) / np.linalg.norm(ref)
        assert err < tol, (quant, o.name, err)
    return sess.manifest["graph"]["nodes"]


@pytest.fixture(params=[6000, 13000], ids=["1-row-bands", "4-row-bands"])
def small_bands(monkeypatch, request):
    """Fuse whatever qualifies, in bands of a few rows, as big images would run. Bands
    of one row expand their depthwise halo again; from 3 rows (stride 1) the next band
    carries those rows over (backend_cpu._bind_mbconv): both paths run."""
    monkeypatch.setattr(mbconv, "FUSE_MIN_BYTES", 0)
    monkeypatch.setattr(mbconv, "BAND_BYTES", request.param)


def test_qualifying_chains_fuse_and_match_onnxruntime(tmp_path, small_bands):
    nodes = _check(tmp_path, _net())
    fused = {n["name"]: n for n in nodes if n["op"] == "mbconv"}
    want = ["a_exp..a_proj", "b_dw..b_proj", "c_dw..c_proj", "e_exp..e_proj"]
    assert sorted(fused) == want, sorted(fused)
    assert fused["a_exp..a_proj"]["inputs"][10], "the block's residual rides on the fused node"
    for name in ("b_dw..b_proj", "c_dw..c_proj"):
        assert "expand" not in fused[name]["attrs"] and not fused[name]["inputs"][1]
    assert fused["e_exp..e_proj"]["attrs"]["dw"]["strides"] == [2, 2]
    assert all(1 <= n["attrs"]["band"] < 14 for n in fused.values())
    ops = {n["name"]: n["op"] for n in nodes}
    assert ops["d_dw"] == "dwconv", "a depthwise output read twice stays a tensor"


@pytest.mark.parametrize(("quant", "tol"), [("int8", 0.05), ("fp16", 1e-3)])
def test_quantized_chains_match_onnxruntime(tmp_path, small_bands, quant, tol):
    # int8: the error table traces the fp32 graph fused the same way
    nodes = _check(tmp_path, _net(), quant, tol)
    assert sum(n["op"] == "mbconv" for n in nodes) == 4


def test_small_chains_stay_separate_by_default(tmp_path):
    nodes = _check(tmp_path, _net())
    assert not [n for n in nodes if n["op"] == "mbconv"]


def test_no_fusion_channels_first(tmp_path, small_bands):
    path = tmp_path / "m.onnx"
    onnx.save(_net(), path)
    sess = load(pack(path, tmp_path / "m.epk", layout="nchw"))
    assert not [n for n in sess.manifest["graph"]["nodes"] if n["op"] == "mbconv"]


def test_band_rows_fit_the_budget():
    # MobileNetV2's first expanded block: 112x112x96 into a stride-2 depthwise conv
    attrs = {"strides": [2, 2], "dilations": [1, 1]}
    rows = mbconv.band_rows((1, 112, 112, 96), (1, 56, 56, 96), attrs, 3)
    e_rows = (rows - 1) * 2 + 3
    assert (e_rows * 112 + rows * 56) * 96 * 4 <= mbconv.BAND_BYTES
    e_more = rows * 2 + 3
    assert (e_more * 112 + (rows + 1) * 56) * 96 * 4 > mbconv.BAND_BYTES
    assert mbconv.band_rows((1, 7, 7, 960), (1, 7, 7, 960), attrs | {"strides": [1, 1]}, 3) == 7
