"""The packager's layout pass (packager/layout.py): which nodes run channels-last, where
the transposes go, and that the bundle computes what ONNX Runtime does either way."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import load, ort_run, pack
from edgepack.kernels import layout as L
from onnx import helper
from test_onnx_import import model, node, rand

pytestmark = pytest.mark.cpu


def _nodes(path) -> list[dict]:
    return load(path).manifest["graph"]["nodes"]


def _check(tmp_path, m: onnx.ModelProto, feeds: dict, **kw) -> list[dict]:
    """Pack with and without the pass; both match ONNX Runtime. The nodes of the
    channels-last bundle."""
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    refs = ort_run(path, feeds)
    for lay in ("auto", "nchw"):
        sess = load(pack(path, tmp_path / f"m-{lay}.epk", layout=lay, **kw))
        got = sess.run(feeds)
        for o, ref in zip(m.graph.output, refs):
            assert got[o.name].shape == ref.shape
            np.testing.assert_allclose(got[o.name], ref, rtol=1e-4, atol=1e-4, err_msg=lay)
    return _nodes(tmp_path / "m-auto.epk")


def _cnn():
    """conv -> relu -> maxpool -> depthwise conv -> 1x1 conv + residual -> global pool
    -> flatten -> gemm: one channels-last region from the first conv to the pool."""
    nodes = [
        node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node(
            "MaxPool",
            ["r0"],
            ["p0"],
            name="pool",
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Conv", ["p0", "wd"], ["d0"], name="dw", group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d0", "w1"], ["c1"], name="pw"),
        helper.make_node("Add", ["c1", "p0"], ["a1"], name="add"),
        helper.make_node("GlobalAveragePool", ["a1"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "wf"], ["y"], name="fc", transB=1),
    ]
    inits = {
        "w0": rand(8, 3, 3, 3),
        "b0": rand(8),
        "wd": rand(8, 1, 3, 3),
        "w1": rand(8, 8, 1, 1),
        "wf": rand(5, 8),
    }
    return model(nodes, [("x", [2, 3, 12, 10])], ["y"], inits)


def test_a_cnn_runs_channels_last_between_one_transpose_in_and_none_out(tmp_path):
    nodes = _check(tmp_path, _cnn(), {"x": rand(2, 3, 12, 10)})
    ops = [n["op"] for n in nodes]
    assert ops == [
        "transpose",
        "conv",
        "maxpool",
        "dwconv",
        "conv",
        "global_avgpool",
        "reshape",
        "linear",
    ], ops
    last = {n["op"]: L.is_nhwc(n["attrs"]) for n in nodes}
    assert last == {
        "transpose": False,
        "conv": True,
        "maxpool": True,
        "dwconv": True,
        "global_avgpool": True,
        "reshape": False,
        "linear": False,
    }
    assert nodes[0]["attrs"]["perm"] == list(L.TO_NHWC)
    sess = load(tmp_path / "m-auto.epk")
    g = sess.manifest["graph"]
    # the stored shapes are channels-last, the graph's input is not
    conv = nodes[1]
    assert g["tensors"][conv["outputs"][0]]["shape"] == [2, 12, 10, 8]
    # HWIO [3, 3, 3, 8] as one 64-wide GEMM panel, zero past the 8 output channels
    assert sess.manifest["weights"][conv["inputs"][1]]["shape"] == [1, 3, 3, 3, 64]
    assert conv["attrs"]["panel"] == 64 and conv["attrs"]["out_channels"] == 8
    assert g["inputs"][0]["shape"] == [2, 3, 12, 10]
    # the residual add was fused into the 1x1 conv, whose residual is channels-last too
    assert nodes[4]["inputs"][4] == nodes[2]["outputs"][0]


def test_layout_nchw_keeps_every_activation_channels_first(tmp_path):
    _check(tmp_path, _cnn(), {"x": rand(2, 3, 12, 10)})
    nodes = _nodes(tmp_path / "m-nchw.epk")
    assert all(not L.is_nhwc(n["attrs"]) for n in nodes)
    assert "transpose" not in [n["op"] for n in nodes]


def test_a_channels_last_graph_output_keeps_its_name_and_shape(tmp_path):
    # the conv's output is the graph's output (and also feeds a second conv)
    m = model(
        [
            node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["y", "w2"], ["z"], name="c2"),
        ],
        [("x", [1, 4, 6, 7])],
        ["y", "z"],
        {"w": rand(5, 4, 3, 3), "w2": rand(3, 5, 1, 1)},
    )
    nodes = _check(tmp_path, m, {"x": rand(1, 4, 6, 7)})
    assert [n["op"] for n in nodes] == ["transpose", "conv", "conv", "transpose", "transpose"]
    assert {n["outputs"][0] for n in nodes[-2:]} == {"y", "z"}


def test_regions_end_at_ops_without_a_channels_last_form(tmp_path):
    # the per-channel add folds into the conv's bias; a softmax over channels runs
    # channels-first; the second conv starts a new region, its input converted again
    nodes = [
        node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "k"], ["a"], name="add_k"),
        helper.make_node("Softmax", ["a"], ["s"], name="sm", axis=1),
        helper.make_node("Conv", ["s", "w2"], ["y"], name="c2"),
    ]
    k = rand(1, 5, 1, 1)
    m = model(
        nodes, [("x", [1, 4, 6, 6])], ["y"], {"w": rand(5, 4, 3, 3), "k": k, "w2": rand(2, 5, 1, 1)}
    )
    got = _check(tmp_path, m, {"x": rand(1, 4, 6, 6)})
    ops = [(n["op"], L.is_nhwc(n["attrs"])) for n in got]
    assert ops == [
        ("transpose", False),
        ("conv", True),
        ("transpose", False),
        ("softmax", False),
        ("transpose", False),
        ("conv", True),
        ("transpose", False),
    ], ops


def test_grouped_convs_stay_channels_first(tmp_path):
    m = model(
        [node("Conv", ["x", "w"], ["y"], group=2, pads=[1, 1, 1, 1])],
        [("x", [1, 4, 5, 5])],
        ["y"],
        {"w": rand(6, 2, 3, 3)},
    )
    nodes = _check(tmp_path, m, {"x": rand(1, 4, 5, 5)})
    assert [(n["op"], L.is_nhwc(n["attrs"])) for n in nodes] == [("conv", False)]


@pytest.mark.parametrize("quant", ["int8", "fp16"])
def test_quantized_bundles_run_channels_last_with_an_error_table(tmp_path, quant):
    # the error table compares per-layer traces of the fp32 and the quantized graph:
    # both take the same layouts, so each tensor is compared element by element
    path = tmp_path / "m.onnx"
    onnx.save(_cnn(), path)
    feeds = {"x": rand(2, 3, 12, 10)}
    sess = load(pack(path, tmp_path / "q.epk", quant=quant, min_weights=0))
    layers = sess.manifest["quantization"]["error"]["layers"]
    assert layers and all(r["cosine"] > 0.99 for r in layers), layers
    assert any(L.is_nhwc(n["attrs"]) for n in sess.manifest["graph"]["nodes"])
    (ref,) = ort_run(path, feeds)
    got = sess.run(feeds)["y"]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_cuda_first_targets_keep_channels_first(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_cnn(), path)
    sess = load(pack(path, tmp_path / "c.epk", backends=("cuda", "cpu", "ref")))
    assert not any(L.is_nhwc(n["attrs"]) for n in sess.manifest["graph"]["nodes"])


@pytest.mark.parametrize("co", [1, 8, 64, 77, 130])
def test_panels_hold_the_hwio_weights_zero_past_co(co):
    hwio = np.random.default_rng(co).standard_normal((3, 2, 5, co)).astype(np.float32)
    p = L.to_panels(hwio)
    assert p.shape == (-(-co // 64), 3, 2, 5, 64)
    assert np.array_equal(L.from_panels(p, co), hwio)
    # panel t holds output channels 64t .. 64t+63 of the [kh*kw*C, Co] matrix
    m = hwio.reshape(-1, co)
    for t in range(p.shape[0]):
        block = p[t].reshape(-1, 64)
        cols = m[:, 64 * t : 64 * (t + 1)]
        assert np.array_equal(block[:, : cols.shape[1]], cols)
        assert not block[:, cols.shape[1] :].any()


def test_int4_rows_interleaved_by_16_hold_the_canonical_bytes():
    """kernels/layout.py q4_interleave: one 64-byte load per run d holds bytes 4d..4d+3 of
    each of 16 rows' block; the scales of the 16 rows lie side by side; undone exactly."""
    from edgepack.kernels import wtypes

    rng = np.random.default_rng(3)
    for group in wtypes.GROUP_SIZES:
        w = rng.standard_normal((48, 200)).astype(np.float32)
        packed, scale = wtypes.QUANTIZE["i4"](w, group)
        pi, si = L.q4_interleave(packed, scale)
        assert pi.shape == packed.shape and si.shape == scale.shape
        assert sorted(pi.ravel()) == sorted(packed.ravel())
        g, b, d, r = 2, 3, 1, 5  # group of rows, block, run, row in the group
        at = (g * (packed.shape[1] // 16) + b) * 256 + d * 64 + r * 4
        assert bytes(pi.reshape(-1)[at : at + 4]) == bytes(packed[16 * g + r, 16 * b + 4 * d :][:4])
        s = 1 if scale.shape[1] > 1 else 0
        assert si.reshape(-1)[(g * scale.shape[1] + s) * 16 + r] == scale[16 * g + r, s]
        back_w, back_s = L.q4_deinterleave(pi, si)
        assert np.array_equal(back_w, packed) and np.array_equal(back_s, scale)
    with pytest.raises(ValueError, match="N % 16"):
        L.q4_interleave(packed[:40], scale[:40])


def test_int8_rows_interleaved_by_16_hold_the_canonical_bytes():
    """kernels/layout.py q8_interleave: per group of 16 rows and block of 32 weights, run
    d's 64 bytes hold weights 4d..4d+3 of each row (8 runs a block); undone exactly;
    K must be whole blocks (int8 rows are not padded)."""
    rng = np.random.default_rng(4)
    w = rng.integers(-127, 128, (48, 96)).astype(np.int8)
    wi = L.q8_interleave(w)
    assert wi.shape == w.shape and wi.dtype == np.int8
    g, b, d, r = 1, 2, 6, 11
    at = ((g * 3 + b) * 8 + d) * 64 + r * 4
    assert bytes(wi.reshape(-1)[at : at + 4]) == bytes(w[16 * g + r, 32 * b + 4 * d :][:4])
    assert np.array_equal(L.q8_deinterleave(wi), w)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        L.q8_interleave(w[:, :40])
