"""Pack-time rewrites of what exporters emit (packager/fuse.py), each through the bundle
against ONNX Runtime: the rewrite must happen (the node count says so) and change
nothing the model computes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load, ort_run, pack
from onnx import helper
from test_onnx_import import model, node, rand

pytestmark = pytest.mark.cpu


def _run(tmp_path, m, feeds):
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    s = load(pack(path, tmp_path / "m.epk"))
    got = s.run(feeds)
    refs = ort_run(path, feeds)
    for o, ref in zip(s.outputs, refs):  # atol: float32 rounding at the output's scale
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(finite.max()) if finite.size else 1.0
        np.testing.assert_allclose(got[o["name"]], ref, rtol=1e-5, atol=1e-6 * max(scale, 10))
    return s.manifest["graph"]["nodes"]


def test_hard_swish_written_as_add_clip_mul_div_becomes_one_epilogue(tmp_path):
    # paddle2onnx's hard-swish: x * clip(x + 3, 0, 6) / 6 after a conv
    lo, hi = np.array(0.0, np.float32), np.array(6.0, np.float32)
    m = model(
        [
            node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c", "three"], ["a"]),
            helper.make_node("Clip", ["a", "lo", "hi"], ["cl"]),
            helper.make_node("Mul", ["c", "cl"], ["m"]),
            helper.make_node("Div", ["m", "six"], ["y"]),
        ],
        [("x", [1, 3, 8, 8])],
        ["y"],
        {"w": rand(4, 3, 3, 3), "three": np.array(3.0, np.float32), "lo": lo, "hi": hi,
         "six": np.array(6.0, np.float32)},  # fmt: skip
    )
    nodes = _run(tmp_path, m, {"x": rand(1, 3, 8, 8) * 4})
    convs = [n for n in nodes if n["op"] == "conv"]
    assert len(convs) == 1 and convs[0]["attrs"]["act"] == "hard_swish"
    assert not [n for n in nodes if n["op"] == "binary"]


def test_conv_bias_add_and_squeeze_excite_mul_stay_channels_last(tmp_path):
    # a conv, an Add of a [1, C, 1, 1] constant (a bias), then a gate [1, C, 1, 1] from
    # a global pool times the map: no transposes between the convs
    m = model(
        [
            node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["p"]),
            helper.make_node("Sigmoid", ["p"], ["g"]),
            helper.make_node("Mul", ["r", "g"], ["s"]),
            helper.make_node("Conv", ["s", "w2"], ["y"]),
        ],
        [("x", [1, 3, 8, 8])],
        ["y"],
        {"w": rand(8, 3, 3, 3), "b": rand(1, 8, 1, 1), "w2": rand(4, 8, 1, 1)},
    )
    nodes = _run(tmp_path, m, {"x": rand(1, 3, 8, 8)})
    ops = [n["op"] for n in nodes]
    assert ops.count("transpose") == 2, ops  # the graph's input and output only
    assert nodes[ops.index("conv")]["attrs"]["act"] == "relu"


@pytest.mark.parametrize("with_bias", [True, False])
def test_consecutive_linears_merge_into_one(tmp_path, with_bias):
    # 16 -> 8 -> 8 with nothing between: W2 W1 (8x16) is no larger than W1 and W2
    inits = {"w1": rand(16, 8), "w2": rand(8, 8), "b1": rand(8), "b2": rand(8)}
    if with_bias:
        body = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
                helper.make_node("Gemm", ["h", "w2", "b2"], ["y"])]  # fmt: skip
    else:
        body = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
                helper.make_node("MatMul", ["h", "w2"], ["y"])]  # fmt: skip
    nodes = _run(tmp_path, model(body, [("x", [4, 16])], ["y"], inits), {"x": rand(4, 16)})
    assert [n["op"] for n in nodes] == ["linear"]


def test_a_low_rank_pair_is_left_as_two_linears(tmp_path):
    # 64 -> 4 -> 64: the product (64x64) is larger than the factors (2 x 64x4)
    body = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("MatMul", ["h", "w2"], ["y"])]  # fmt: skip
    m = model(body, [("x", [2, 64])], ["y"], {"w1": rand(64, 4), "w2": rand(4, 64)})
    nodes = _run(tmp_path, m, {"x": rand(2, 64)})
    assert [n["op"] for n in nodes] == ["linear", "linear"]


def test_sibling_projections_share_one_gemm(tmp_path):
    # Q, K, V projections of one input, then Q K^T: one linear of 3x the columns, sliced
    m = model(
        [
            helper.make_node("MatMul", ["x", "wq"], ["q"]),
            helper.make_node("MatMul", ["x", "wk"], ["k"]),
            helper.make_node("MatMul", ["x", "wv"], ["v"]),
            helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node("MatMul", ["s", "v"], ["y"]),
        ],
        [("x", [2, 5, 12])],
        ["y"],
        {"wq": rand(12, 6), "wk": rand(12, 6), "wv": rand(12, 6)},
    )
    nodes = _run(tmp_path, m, {"x": rand(2, 5, 12)})
    linears = [n for n in nodes if n["op"] == "linear"]
    assert len(linears) == 1 and [n["op"] for n in nodes].count("slice") == 3


def test_silu_written_as_sigmoid_and_mul_becomes_the_convs_epilogue(tmp_path):
    # YOLO's SiLU as torch.onnx writes it: Conv, Sigmoid, Mul(conv, sigmoid)
    m = model(
        [
            node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", ["c"], ["s"]),
            helper.make_node("Mul", ["c", "s"], ["y"]),
        ],
        [("x", [1, 3, 8, 8])],
        ["y"],
        {"w": rand(4, 3, 3, 3)},
    )
    x = rand(1, 3, 8, 8) * 6
    x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]  # as ORT: NaN, NaN/inf through the conv
    nodes = _run(tmp_path, m, {"x": x})
    assert [(n["op"], n["attrs"].get("act")) for n in nodes if n["op"] != "transpose"] == [
        ("conv", "silu")
    ]


@pytest.mark.parametrize("grouping", ["x_then_half", "half_first", "gelu_op"])
def test_gelu_written_with_erf_becomes_the_linears_epilogue(tmp_path, grouping):
    # torch.onnx before opset 20: x * 0.5 * (1 + erf(x / sqrt 2)), or ONNX's Gelu (20)
    c = {"w": rand(16, 32), "b": rand(32), "r2": np.array(2**0.5, np.float32),
         "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)}  # fmt: skip
    head = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["h"]),
    ]
    erf = [helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
           helper.make_node("Add", ["e", "one"], ["e1"])]  # fmt: skip
    if grouping == "x_then_half":
        body = erf + [helper.make_node("Mul", ["h", "e1"], ["p"]),
                      helper.make_node("Mul", ["p", "half"], ["y"])]  # fmt: skip
    elif grouping == "half_first":
        body = erf + [helper.make_node("Mul", ["h", "half"], ["hh"]),
                      helper.make_node("Mul", ["hh", "e1"], ["y"])]  # fmt: skip
    else:
        body = [helper.make_node("Gelu", ["h"], ["y"])]
    m = model(head + body, [("x", [4, 16])], ["y"], c, opset=20)
    x = rand(4, 16) * 3
    nodes = _run(tmp_path, m, {"x": x})
    assert [n["op"] for n in nodes] == ["linear"] and nodes[0]["attrs"]["act"] == "gelu"


def _attention(pattern: str):
    """An exporter's attention over q, k, v [1, 2, 5, 8] graph inputs: ``sdpa_export``
    torch's SDPA (q and k^T each scaled by a root of the scale, a float mask added,
    Where(IsNaN(p), 0, p) after the softmax), ``bert`` MatMul, Div by sqrt(d), Add of
    the mask, ``whisper`` q scaled first, no mask."""
    c = np.array(8.0**-0.25, np.float32)
    kt = helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])
    if pattern == "sdpa_export":
        nodes = [kt, helper.make_node("Mul", ["q", "c"], ["qs"]),
                 helper.make_node("Mul", ["kt", "c"], ["ks"]),
                 helper.make_node("MatMul", ["qs", "ks"], ["s"]),
                 helper.make_node("Add", ["s", "mask"], ["sm"]),
                 helper.make_node("Softmax", ["sm"], ["p0"], axis=-1),
                 helper.make_node("IsNaN", ["p0"], ["nan"]),
                 helper.make_node("Where", ["nan", "zero", "p0"], ["p"])]  # fmt: skip
    elif pattern == "bert":
        nodes = [kt, helper.make_node("MatMul", ["q", "kt"], ["s"]),
                 helper.make_node("Div", ["s", "root"], ["sd"]),
                 helper.make_node("Add", ["sd", "mask"], ["sm"]),
                 helper.make_node("Softmax", ["sm"], ["p"], axis=3)]  # fmt: skip
    else:
        nodes = [kt, helper.make_node("Mul", ["q", "inv"], ["qs"]),
                 helper.make_node("MatMul", ["qs", "kt"], ["s"]),
                 helper.make_node("Softmax", ["s"], ["p"], axis=-1)]  # fmt: skip
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"]))
    inits = {"c": c, "zero": np.array(0.0, np.float32), "root": np.array(8.0**0.5, np.float32),
             "inv": np.array(8.0**-0.5, np.float32)}  # fmt: skip
    ins = [(n, [1, 2, 5, 8]) for n in "qkv"]
    if pattern != "whisper":
        ins.append(("mask", [1, 1, 5, 5]))
    return model(nodes, ins, ["y"], inits)


@pytest.mark.parametrize("pattern", ["sdpa_export", "bert", "whisper"])
def test_an_exporters_attention_chain_becomes_one_sdpa(tmp_path, pattern):
    feeds = {n: rand(1, 2, 5, 8) * 2 for n in "qkv"}
    if pattern != "whisper":
        mask = np.zeros((1, 1, 5, 5), np.float32)
        mask[..., 3:] = np.finfo(np.float32).min  # padding: the last two keys
        if pattern == "sdpa_export":
            mask[..., 1, :] = -np.inf  # a fully masked row: NaN, which the Where zeroes
        feeds["mask"] = mask
    nodes = _run(tmp_path, _attention(pattern), feeds)
    assert [n["op"] for n in nodes if n["op"] != "transpose"] == ["sdpa"]
