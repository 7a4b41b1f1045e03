"""u8 codes between int8 ops (packager/act_quant.py ``int8_codes``): which outputs are
written as the codes of the int8 convs that read them, which depthwise convs become
``qdwconv``, and that the bundle still computes what ONNX Runtime does (the kernels
are checked one by one in test_kernels.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import test_onnx_import
from conftest import load, ort_run, pack
from edgepack.packager import build as build_mod
from test_mbconv import _net
from test_onnx_import import rand

pytestmark = pytest.mark.cpu


def _int8_net(tmp_path, monkeypatch) -> tuple:
    """(_net saved as ONNX, the build arguments): the same weights and inputs whatever
    ran before on this worker, all weights int8, and no layer kept fp32 by the
    output-cosine search (which would change the graph)."""
    monkeypatch.setattr(test_onnx_import, "RNG", np.random.default_rng(42))
    path = tmp_path / "m.onnx"
    onnx.save(_net(), path)
    np.savez(tmp_path / "calib.npz", x=np.stack([rand(8, 14, 13) for _ in range(4)]))
    common = {"quant": "int8", "act_quant": "int8", "min_weights": 0, "min_cosine": 0,
              "calib": tmp_path / "calib.npz"}  # fmt: skip
    return path, common


def test_codes_only_where_int8_convs_alone_read_them(tmp_path, monkeypatch):
    """_net's blocks (test_mbconv.py), all weights int8 (--quant-min-weights 0):
    - a depthwise conv whose output only a qconv reads writes its codes (a_dw, b_dw,
      and c_dw at stride 2); one whose output is also pooled (d_dw), or whose kernel is
      5x5 (e_dw), stays a float32 dwconv;
    - a qconv's output that only qconvs read is codes (a_proj with its residual, into
      b_exp; c_proj into d_exp; d_proj into e_exp); one that feeds a depthwise conv
      (a_exp, b_proj), or is a graph output (b_exp, e_proj), is float32.
    The codes change the bytes, not the answer: the same build with float32 between
    the int8 ops gives the same outputs (a code may move by one where the reciprocal's
    product and the quotient round apart), and both are near ONNX Runtime's."""
    path, common = _int8_net(tmp_path, monkeypatch)
    sess = load(pack(path, tmp_path / "q.epk", **common))
    graph = sess.manifest["graph"]
    ops = {n["name"]: n["op"] for n in graph["nodes"]}
    assert {k for k, v in ops.items() if v == "qdwconv"} == {"a_dw", "b_dw", "c_dw"}
    assert ops["d_dw"] == ops["e_dw"] == "dwconv"
    by_out = {n["outputs"][0]: n["name"] for n in graph["nodes"]}
    codes = {by_out[t] for t, v in graph["tensors"].items() if v["dtype"] == "u8"}
    assert codes == {"a_dw", "b_dw", "c_dw", "a_proj", "c_proj", "d_proj"}, codes
    for n in graph["nodes"]:
        coded = graph["tensors"][n["outputs"][0]]["dtype"] == "u8"
        assert coded == ("y_scale" in n["attrs"]), n["name"]
    # the error table shows the codes as the values they stand for
    rows = {r["node"]: r for r in sess.manifest["quantization"]["error"]["layers"]}
    assert rows["b_dw"]["cosine"] > 0.99 and rows["c_proj"]["cosine"] > 0.99

    monkeypatch.setattr(build_mod, "int8_codes", lambda g, ranges: (0, 0))
    floats = load(pack(path, tmp_path / "f.epk", **common))
    assert "u8" not in {v["dtype"] for v in floats.manifest["graph"]["tensors"].values()}
    feeds = {"x": rand(1, 8, 14, 13)}
    got, plain = sess.run(feeds), floats.run(feeds)
    for o, ref in zip(["y", "b_out", "d_pool"], ort_run(path, feeds), strict=True):
        err = np.linalg.norm(got[o] - plain[o]) / np.linalg.norm(plain[o])
        assert err < 1e-3, (o, err)
        cos = float(np.dot(got[o].ravel(), ref.ravel()))
        cos /= float(np.linalg.norm(got[o]) * np.linalg.norm(ref))
        assert cos > 0.97, (o, cos)  # random weights, 4 calibration inputs


@pytest.mark.parametrize(("band_bytes", "bands"), [(1, [1, 1]), (4096, [1, 4]), (1 << 30, [7, 14])],
                         ids=["rows1", "some", "whole"])  # fmt: skip
def test_int8_chains_run_in_bands_with_the_same_answer(tmp_path, monkeypatch, band_bytes, bands):
    """qconv -> qdwconv -> qconv chains become one ``qmbconv`` (packager/mbconv.py)
    when their expanded tensor is big enough (here: always): _net's A, and B's
    projection (float32 into C's depthwise conv) with C. The bands recompute the rows
    they share and call the same kernels on views, so the outputs are the unfused
    build's to the bit, in one-row bands, several rows (C: 7 output rows as 4 + 3), or
    one band."""
    from edgepack.packager import mbconv

    path, common = _int8_net(tmp_path, monkeypatch)
    plain = load(pack(path, tmp_path / "plain.epk", **common))
    monkeypatch.setattr(mbconv, "QFUSE_MIN_BYTES", 0)
    monkeypatch.setattr(mbconv, "QBAND_BYTES", band_bytes)
    fused = load(pack(path, tmp_path / "fused.epk", **common))
    nodes = {n["name"]: n for n in fused.manifest["graph"]["nodes"]}
    chains = {k for k, n in nodes.items() if n["op"] == "qmbconv"}
    assert chains == {"a_exp..a_proj", "b_proj..c_proj"}, chains
    assert {k for k, n in nodes.items() if n["op"] == "qdwconv"} == {"b_dw"}  # B's expand: out
    assert sorted(nodes[k]["attrs"]["band"] for k in chains) == bands
    # c_proj's output is codes (d_exp reads them), a_proj's too (into b_exp)
    for k in chains:
        assert "y_scale" in nodes[k]["attrs"] and "y_scale" not in nodes[k]["attrs"]["project"]
    feeds = {"x": rand(1, 8, 14, 13)}
    got, want = fused.run(feeds), plain.run(feeds)
    for o in want:
        np.testing.assert_array_equal(got[o], want[o], err_msg=o)
