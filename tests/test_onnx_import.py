"""Importer semantics, op by op, against ONNX Runtime - always through a bundle."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import cli_env, load, ort_run, pack
from edgepack.packager.ir import PackError
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.cpu
F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(v, k) for k, v in dict(inits).items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def check(tmp_path, m: onnx.ModelProto, feeds: dict, atol=1e-4, **kw) -> dict:
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    sess = load(pack(path, tmp_path / "m.epk", **kw))
    got = sess.run(feeds)
    refs = ort_run(path, feeds)
    for o, ref in zip(m.graph.output, refs):
        np.testing.assert_allclose(got[o.name], ref, rtol=1e-4, atol=atol, err_msg=o.name)
    return got


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op.lower()}_node", **attrs)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad(tmp_path, auto_pad):
    m = model(
        [node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, strides=[2, 2])],
        [("x", [1, 3, 9, 10])],
        ["y"],
        {"w": rand(4, 3, 3, 3)},
    )
    check(tmp_path, m, {"x": rand(1, 3, 9, 10)})


def test_grouped_dilated_conv_with_bias_bn_relu(tmp_path):
    nodes = [
        node("Conv", ["x", "w", "b"], ["c"], group=2, dilations=[2, 1], pads=[2, 1, 0, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "be", "mu", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    inits = {
        "w": rand(6, 2, 3, 3),
        "b": rand(6),
        "g": rand(6),
        "be": rand(6),
        "mu": rand(6),
        "var": np.abs(rand(6)) + 0.5,
    }
    m = model(nodes, [("x", [2, 4, 8, 8])], ["y"], inits)
    check(tmp_path, m, {"x": rand(2, 4, 8, 8)})
    sess = load(tmp_path / "m.epk")
    assert [n["op"] for n in sess.manifest["graph"]["nodes"]] == ["conv"]  # BN + relu fused


def test_standalone_batchnorm_and_activations(tmp_path):
    acts = [
        ("LeakyRelu", {"alpha": 0.2}),
        ("Sigmoid", {}),
        ("Tanh", {}),
        ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
        ("HardSwish", {}),
        ("Relu", {}),
    ]
    nodes = [
        helper.make_node(
            "BatchNormalization", ["x", "g", "be", "mu", "var"], ["t0"], name="bn", epsilon=1e-3
        )
    ]
    for i, (op, attrs) in enumerate(acts):
        nodes.append(helper.make_node(op, [f"t{i}"], [f"t{i + 1}"], name=f"a{i}", **attrs))
    nodes.append(helper.make_node("Clip", [f"t{len(acts)}", "lo"], ["y"], name="clip"))
    inits = {
        "g": rand(3),
        "be": rand(3),
        "mu": rand(3),
        "var": np.abs(rand(3)) + 0.5,
        "lo": np.array(0.1, np.float32),
    }
    m = model(nodes, [("x", [1, 3, 5, 5])], ["y"], inits)
    check(tmp_path, m, {"x": rand(1, 3, 5, 5) * 3})


def test_gemm_variants(tmp_path):
    nodes = [
        node("Gemm", ["a", "b", "c"], ["y1"], transA=1, alpha=0.5, beta=2.0),
        helper.make_node("Gemm", ["y1", "b2", "c2"], ["y2"], name="gemm2", transB=1),
    ]
    inits = {"b": rand(6, 5), "c": rand(4, 5), "b2": rand(3, 5), "c2": rand(1, 3)}
    m = model(nodes, [("a", [6, 4])], ["y1", "y2"], inits)
    check(tmp_path, m, {"a": rand(6, 4)})


def test_matmul_constant_and_batched(tmp_path):
    nodes = [
        node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "bias"], ["h2"], name="bias_add"),
        helper.make_node("Transpose", ["h2"], ["ht"], name="tr", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h2", "ht"], ["y"], name="bmm"),
        helper.make_node("Softmax", ["y"], ["s"], name="sm", axis=1),
    ]
    m = model(nodes, [("x", [2, 3, 4])], ["s", "y"], {"w": rand(4, 5), "bias": rand(5)})
    check(tmp_path, m, {"x": rand(2, 3, 4)})


def test_binary_broadcasting(tmp_path):
    nodes = [
        node("Add", ["x", "c"], ["a"]),
        helper.make_node("Mul", ["a", "s"], ["b"], name="mul"),
        helper.make_node("Sub", ["k", "b"], ["c2"], name="sub"),
        helper.make_node("Div", ["c2", "x"], ["y"], name="div"),
    ]
    inits = {"c": rand(1, 3, 1, 1), "s": np.array(2.5, np.float32), "k": rand(4)}
    m = model(nodes, [("x", [2, 3, 5, 4])], ["y"], inits)
    x = rand(2, 3, 5, 4)
    x[np.abs(x) < 0.1] = 0.5
    check(tmp_path, m, {"x": x}, atol=1e-3)


@pytest.mark.parametrize("ceil", [0, 1])
def test_pooling(tmp_path, ceil):
    nodes = [
        node(
            "MaxPool",
            ["x"],
            ["m"],
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 1, 0, 0],
            ceil_mode=ceil,
        ),
        helper.make_node(
            "AveragePool",
            ["m"],
            ["a"],
            name="ap",
            kernel_shape=[2, 3],
            strides=[2, 2],
            pads=[0, 1, 1, 1],
            count_include_pad=1,
            ceil_mode=ceil,
        ),
        helper.make_node("GlobalAveragePool", ["a"], ["y"], name="gap"),
    ]
    m = model(nodes, [("x", [1, 2, 11, 10])], ["a", "y"])
    check(tmp_path, m, {"x": rand(1, 2, 11, 10)})


def test_shape_ops_and_folding(tmp_path):
    """A torch-style Shape -> Gather -> Concat -> Reshape chain folds away."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"], name="unsq_n"),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], name="cat_shape", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"], name="reshape"),
        helper.make_node("Unsqueeze", ["flat", "ax1"], ["u"], name="unsq"),
        helper.make_node("Squeeze", ["u", "ax1"], ["sq"], name="sq"),
        helper.make_node("Flatten", ["x"], ["f2"], name="flatten", axis=2),
        helper.make_node("ReduceMean", ["f2"], ["rm"], name="rm", axes=[1], keepdims=0),
        helper.make_node("Identity", ["sq"], ["id"], name="id"),
        helper.make_node("Concat", ["id", "id"], ["y"], name="cat", axis=1),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "ax0": np.array([0], np.int64),
        "minus1": np.array([-1], np.int64),
        "ax1": np.array([1], np.int64),
    }
    m = model(nodes, [("x", [3, 2, 4, 5])], ["y", "rm"], inits)
    check(tmp_path, m, {"x": rand(3, 2, 4, 5)})
    ops = [n["op"] for n in load(tmp_path / "m.epk").manifest["graph"]["nodes"]]
    assert "Shape" not in ops and ops.count("concat") == 1


def test_opset18_reduce_and_pad(tmp_path):
    nodes = [
        node("ReduceMean", ["x", "axes"], ["r"], keepdims=1),
        helper.make_node("Pad", ["r", "pads", "val"], ["p"], name="padc", mode="constant"),
        helper.make_node("Pad", ["x", "pads2", "", "axes2"], ["q"], name="padr", mode="reflect"),
        helper.make_node("Pad", ["x", "pads2", "", "axes2"], ["e"], name="pade", mode="edge"),
    ]
    inits = {
        "axes": np.array([1, 3], np.int64),
        "pads": np.array([0, 1, 0, 2, 0, 0, 1, 0]),
        "val": np.array(1.5, np.float32),
        "pads2": np.array([1, 2, 2, 1]),
        "axes2": np.array([2, 3], np.int64),
    }
    m = model(nodes, [("x", [1, 3, 4, 5])], ["p", "q", "e"], inits, opset=18)
    check(tmp_path, m, {"x": rand(1, 3, 4, 5)})


def test_opset21_24_and_opset11_models(tmp_path):
    for opset in (21, 24):  # 22-24 changed these ops' type lists only (bf16, float8/4)
        m = model([node("Relu", ["x"], ["r"]), node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2])],
                  [("x", [1, 2, 4, 4])], ["y"], opset=opset)  # fmt: skip
        check(tmp_path, m, {"x": rand(1, 2, 4, 4)})
    m11 = model([node("Squeeze", ["x"], ["y"], axes=[0])], [("x", [1, 3])], ["y"], opset=11)
    m11.ir_version = 6
    check(tmp_path, m11, {"x": rand(1, 3)})


def test_dynamic_batch_and_input_shape(tmp_path):
    g = helper.make_graph(
        [node("Relu", ["x"], ["y"])],
        "t",
        [helper.make_tensor_value_info("x", F, ["N", 3, "H"])],
        [helper.make_tensor_value_info("y", F, None)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "dyn.onnx"
    onnx.save(m, path)
    with pytest.raises(PackError, match="--input-shape x="):
        pack(path, tmp_path / "a.epk")
    with pytest.raises(PackError, match="does not fit"):
        pack(path, tmp_path / "a.epk", input_shapes={"x": (2, 4, 5)})
    s = load(pack(path, tmp_path / "a.epk", input_shapes={"x": (2, 3, 7)}))
    assert s.inputs[0]["shape"] == [2, 3, 7]


@pytest.mark.parametrize(
    "make,needle",
    [
        (
            lambda: model(
                [node("Einsum", ["x", "x"], ["y"], equation="ij,ij->i")], [("x", [2, 2])], ["y"]
            ),
            "op Einsum at node 'einsum_node'",
        ),
        (
            lambda: model(
                [node("Pad", ["x", "p"], ["y"], mode="wrap")],
                [("x", [1, 4])],
                ["y"],
                {"p": np.array([0, 1, 0, 1])},
                opset=19,
            ),
            "mode='wrap'",
        ),
        (
            lambda: model(
                [node("Conv", ["x", "w"], ["y"])],
                [("x", [1, 2, 5, 5, 5])],
                ["y"],
                {"w": rand(2, 2, 3, 3, 3)},
            ),
            "only 2-D convolutions",
        ),
        (
            lambda: model([node("Relu", ["x"], ["y"])], [("x", [2])], ["y"], opset=26),
            "model uses ONNX opset 26; supported: up to 24",
        ),
    ],
)
def test_unsupported_inputs_name_op_and_node(tmp_path, make, needle):
    path = tmp_path / "bad.onnx"
    onnx.save(make(), path)
    with pytest.raises(PackError) as e:
        pack(path, tmp_path / "bad.epk")
    assert needle in str(e.value)
    assert not (tmp_path / "bad.epk").exists()


def test_unsupported_input_dtype(tmp_path):
    # a string input has no arena dtype; an int64 one does, but Relu takes float32
    int64 = r"unary of \['i64'\]: float32 tensors; inputs 'x' \(i64\)"
    for dtype, needle in ((TensorProto.STRING, "'x' has ONNX element type STRING"),
                          (TensorProto.INT64, int64)):  # fmt: skip
        g = helper.make_graph(
            [node("Relu", ["x"], ["y"])],
            "t",
            [helper.make_tensor_value_info("x", dtype, [2])],
            [helper.make_tensor_value_info("y", dtype, None)],
        )
        path = tmp_path / "i.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        with pytest.raises(PackError, match=needle):
            pack(path, tmp_path / "i.epk")


@pytest.mark.parametrize("axis", [-1, -3, 0, 2, 3])
def test_flatten_axes_as_onnx_runtime_reads_them(tmp_path, axis):
    # a negative axis counts from the end: -1 of a rank-3 tensor is axis 2 (it had been
    # read as axis % (rank + 1) = 3, a silently wrong shape)
    m = model([node("Flatten", ["x"], ["y"], axis=axis)], [("x", [2, 3, 4])], ["y"])
    got = check(tmp_path, m, {"x": rand(2, 3, 4)})
    ax = axis % 3 if axis < 0 else axis
    assert got["y"].shape == (int(np.prod((2, 3, 4)[:ax])), int(np.prod((2, 3, 4)[ax:])))


def test_an_optional_graph_input_is_refused_in_one_line(tmp_path):
    opt = helper.make_value_info(
        "x", helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    )
    g = helper.make_graph([node("Identity", ["x"], ["y"])], "t", [opt],
                          [helper.make_tensor_value_info("y", F, None)])  # fmt: skip
    path = tmp_path / "o.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(PackError, match="'x' is of ONNX type optional_type; edgepack takes"):
        pack(path, tmp_path / "o.epk")


@pytest.mark.parametrize(("op", "axis", "bias"), [("LayerNormalization", -1, True),
                                                  ("LayerNormalization", 1, False),
                                                  ("RMSNormalization", -1, False),
                                                  ("RMSNormalization", -2, False)])  # fmt: skip
def test_layer_and_rms_normalization_with_constant_weights(tmp_path, op, axis, bias):
    # as exporters write them (opset 17 LayerNormalization, opset 23 RMSNormalization):
    # the scale (and bias) initializers of the normalized axes, here broadcast from fewer
    xs = (2, 3, 4, 5)
    inner = xs[axis:] if axis >= 0 else xs[len(xs) + axis :]
    inits = {"s": rand(*inner[-1:]) + 1.0}
    if bias:
        inits["b"] = rand(*inner)
    ins = ["x", "s"] + (["b"] if bias else [])
    m = model([node(op, ins, ["y"], axis=axis, epsilon=1e-4)], [("x", list(xs))], ["y"], inits,
              opset=23 if op == "RMSNormalization" else 17)  # fmt: skip
    if op == "RMSNormalization":
        m.ir_version = 11
    check(tmp_path, m, {"x": rand(*xs) * 3 + 1})


@pytest.mark.parametrize(("op", "xs", "attrs", "opset"), [
    ("InstanceNormalization", (2, 3, 4, 5), {}, 17),
    ("InstanceNormalization", (1, 4, 7), {"epsilon": 1e-3}, 17),
    ("GroupNormalization", (2, 6, 3, 3), {"num_groups": 3}, 21),
    ("GroupNormalization", (1, 4, 5, 2), {"num_groups": 2}, 18),  # opset 18: per group
])  # fmt: skip
def test_instance_and_group_normalization(tmp_path, op, xs, attrs, opset):
    c = xs[1]
    per = attrs["num_groups"] if op == "GroupNormalization" and opset < 21 else c
    inits = {"s": rand(per) + 1.0, "b": rand(per)}
    m = model([node(op, ["x", "s", "b"], ["y"], **attrs)], [("x", list(xs))], ["y"], inits,
              opset=opset)  # fmt: skip
    if opset >= 21:
        m.ir_version = 10
    check(tmp_path, m, {"x": rand(*xs) * 2 + 0.5})


RESIZE = [
    # (mode, transform, extra attrs, scales or None, sizes or None)
    ("nearest", "asymmetric", {"nearest_mode": "floor"}, [1, 1, 2, 2], None),  # YOLO's
    ("nearest", "half_pixel", {}, [1, 1, 1.5, 0.75], None),
    ("nearest", "align_corners", {"nearest_mode": "round_prefer_ceil"}, None, [1, 2, 9, 4]),
    ("nearest", "tf_crop_and_resize", {"nearest_mode": "ceil"}, None, [1, 2, 5, 5]),
    ("linear", "half_pixel", {}, [1, 1, 2, 2], None),
    ("linear", "pytorch_half_pixel", {}, None, [1, 2, 1, 12]),
    ("linear", "align_corners", {}, [1, 1, 0.6, 1.7], None),
    ("linear", "half_pixel_symmetric", {}, [1, 1, 1.3, 0.7], None),
    ("linear", "half_pixel", {"antialias": 1}, [1, 1, 0.4, 0.5], None),
    ("cubic", "half_pixel", {}, [1, 1, 2, 1.5], None),
    ("cubic", "asymmetric", {"cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 0.8, 2], None),
    ("cubic", "half_pixel", {"antialias": 1}, None, [1, 2, 3, 3]),
]


@pytest.mark.parametrize(("mode", "transform", "extra", "scales", "sizes"), RESIZE)
def test_resize_matches_onnx_runtime(tmp_path, mode, transform, extra, scales, sizes):
    inits = {"roi": np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 0.8], np.float32)}
    if scales is not None:
        inits["scales"] = np.array(scales, np.float32)
    else:
        inits["sizes"] = np.array(sizes, np.int64)
    ins = ["x", "roi", "scales" if scales is not None else "", "sizes" if sizes else ""]
    n = node("Resize", ins, ["y"], mode=mode, coordinate_transformation_mode=transform, **extra)
    m = model([n], [("x", [1, 2, 7, 8])], ["y"], inits, opset=19)
    m.ir_version = 9
    check(tmp_path, m, {"x": rand(1, 2, 7, 8)})


@pytest.mark.parametrize(("xs", "ws", "attrs"), [
    ((1, 4, 5, 6), (4, 3, 2, 2), {"strides": [2, 2]}),  # PP-OCR's DB head
    ((2, 3, 4, 4), (3, 5, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 4, 5, 5), (4, 2, 3, 3), {"dilations": [2, 2], "group": 2}),
    ((1, 2, 3, 4), (2, 2, 4, 4), {"strides": [3, 3], "pads": [1, 0, 2, 1],
                                  "output_padding": [1, 2]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 2], "output_shape": [8, 8]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
])  # fmt: skip
def test_conv_transpose_matches_onnx_runtime(tmp_path, xs, ws, attrs):
    inits = {"w": rand(*ws), "b": rand(ws[1] * attrs.get("group", 1))}
    m = model([node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)], [("x", list(xs))], ["y"],
              inits)  # fmt: skip
    check(tmp_path, m, {"x": rand(*xs)})


@pytest.mark.parametrize(("op", "axes", "keepdims", "opset"), [
    ("ReduceSum", [1], 1, 13), ("ReduceMax", [-1], 0, 18), ("ReduceL2", [2, 3], 1, 18),
    ("ReduceLogSumExp", [1], 1, 18), ("ReduceMin", None, 0, 17), ("ReduceProd", [0], 1, 18),
])  # fmt: skip
def test_reduce_ops_with_constant_axes(tmp_path, op, axes, keepdims, opset):
    # axes an attribute before its opset (13 for ReduceSum, 18 for the others), an input
    # (a constant) from it; none: every axis
    inits, ins, attrs = {}, ["x"], {"keepdims": keepdims}
    if axes is not None and opset >= (13 if op == "ReduceSum" else 18):
        inits["axes"] = np.array(axes, np.int64)
        ins.append("axes")
    elif axes is not None:
        attrs["axes"] = axes
    m = model([node(op, ins, ["y"], **attrs)], [("x", [2, 3, 4, 5])], ["y"], inits, opset=opset)
    check(tmp_path, m, {"x": rand(2, 3, 4, 5) * 0.5 + 1.0})


def test_global_max_pool(tmp_path):
    m = model([node("GlobalMaxPool", ["x"], ["y"])], [("x", [2, 3, 5, 4])], ["y"])
    check(tmp_path, m, {"x": rand(2, 3, 5, 4)})


@pytest.mark.parametrize(("axis", "indices"), [
    (1, np.array(0, np.int64)),  # a class token: x[:, 0]
    (2, np.array([3, 1, 1, -1], np.int64)),  # uneven, repeated, negative
    (0, np.array([[0, 1], [1, 0]], np.int64)),  # 2-D indices
    (2, np.array([0, 2, 4], np.int64)),  # a stride: a slice
])  # fmt: skip
def test_gather_of_a_run_time_tensor_at_constant_indices(tmp_path, axis, indices):
    m = model([node("Gather", ["x", "i"], ["y"], axis=axis)], [("x", [2, 3, 5])], ["y"],
              {"i": indices})  # fmt: skip
    check(tmp_path, m, {"x": rand(2, 3, 5)})


@pytest.mark.parametrize(("xs", "shape"), [((3, 1), [2, 3, 4]), ((1, 4), [3, 1]), ((2, 3), [2, 3])])
def test_expand_of_a_run_time_tensor(tmp_path, xs, shape):
    m = model([node("Expand", ["x", "s"], ["y"])], [("x", list(xs))], ["y"],
              {"s": np.array(shape, np.int64)})  # fmt: skip
    check(tmp_path, m, {"x": rand(*xs)})


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 1]}, {"strides": [2], "dilations": [2], "pads": [2, 0]},
    {"group": 2, "auto_pad": "SAME_UPPER"}, {"group": 4},
])  # fmt: skip
def test_1d_conv_as_the_voice_models_have_it(tmp_path, attrs):
    g = attrs.get("group", 1)
    m = model([node("Conv", ["x", "w", "b"], ["c"], **attrs), node("Relu", ["c"], ["r"]),
               node("MaxPool", ["r"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1])],
              [("x", [2, 4, 17])], ["y"], {"w": rand(8, 4 // g, 3), "b": rand(8)})  # fmt: skip
    check(tmp_path, m, {"x": rand(2, 4, 17)})


def test_1d_average_pool(tmp_path):
    m = model([node("AveragePool", ["x"], ["y"], kernel_shape=[4], strides=[3], pads=[1, 2],
                    count_include_pad=1)], [("x", [1, 3, 20])], ["y"])  # fmt: skip
    check(tmp_path, m, {"x": rand(1, 3, 20)})


@pytest.mark.parametrize(("op", "attrs", "xs"), [
    ("DepthToSpace", {"blocksize": 2, "mode": "DCR"}, (1, 8, 3, 4)),
    ("DepthToSpace", {"blocksize": 2, "mode": "CRD"}, (2, 8, 3, 2)),
    ("SpaceToDepth", {"blocksize": 2}, (1, 3, 4, 6)),
    ("Hardmax", {"axis": 1}, (2, 5, 3)),
    ("LpNormalization", {"axis": 1, "p": 1}, (2, 5, 3)),
])  # fmt: skip
def test_composite_ops_match_onnx_runtime(tmp_path, op, attrs, xs):
    # DepthToSpace / SpaceToDepth as reshape-transpose-reshape, Hardmax as argmax ==
    # ramp, LpNormalization as reduce and divide
    m = model([node(op, ["x"], ["y"], **attrs)], [("x", list(xs))], ["y"])
    x = np.round(rand(*xs) * 2) if op == "Hardmax" else rand(*xs)  # ties: the first wins
    check(tmp_path, m, {"x": x})


def test_1d_conv_transpose(tmp_path):
    # a 1-D upsampling (audio decoders) through the 2-D kernel
    up = node("ConvTranspose", ["x", "w"], ["y"], strides=[2], pads=[1, 0], output_padding=[1])
    m = model([up], [("x", [1, 3, 9])], ["y"], {"w": rand(3, 4, 4)})
    check(tmp_path, m, {"x": rand(1, 3, 9)})


def test_const_input_fixes_shape_operands_at_pack_time(tmp_path):
    """--const-input: a Resize's scales and a Slice's starts given as graph inputs are
    fixed at pack time; the bundle takes the data input only and answers as ORT fed
    the same values. Bad values are refused naming the input."""
    import subprocess
    import sys

    nodes = [
        node("Resize", ["x", "", "scales"], ["r"], mode="nearest"),
        node("Slice", ["r", "starts", "ends", "axes"], ["y"]),
    ]
    m = model(nodes, [("x", [1, 2, 3, 4]), ("starts", [1]), ("ends", [1]), ("axes", [1])],
              ["y"], opset=18)  # fmt: skip
    for name in ("starts", "ends", "axes"):
        inp = next(i for i in m.graph.input if i.name == name)
        inp.type.tensor_type.elem_type = TensorProto.INT64
    m.graph.input.append(helper.make_tensor_value_info("scales", F, [4]))
    path = tmp_path / "shape_inputs.onnx"
    onnx.save(m, path)
    with pytest.raises(PackError, match="'scales' must be a constant known at pack time"):
        pack(path, tmp_path / "a.epk")
    x = rand(1, 2, 3, 4)
    values = {"scales": np.array([1, 1, 2, 2], np.float32), "starts": np.array([1]),
              "ends": np.array([5]), "axes": np.array([2])}  # fmt: skip
    npy = tmp_path / "scales.npy"
    np.save(npy, values["scales"])
    out = tmp_path / "fixed.epk"
    r = subprocess.run(
        [sys.executable, "-m", "edgepack.cli", "build", str(path), "-o", str(out),
         "--const-input", f"scales={npy}", "--const-input", "starts=1",
         "--const-input", "ends=5", "--const-input", "axes=2"],
        capture_output=True, text=True, env=cli_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "input 'scales' fixed at pack time" in r.stdout
    s = load(out)
    assert [i["name"] for i in s.inputs] == ["x"]
    want = ort_run(m, {"x": x, **values})[0]
    np.testing.assert_array_equal(s.run({"x": x})["y"], want)
    for bad, needle in (
        ({"scales": np.ones(3, np.float32)}, r"values of shape \[3\] do not fit"),
        ({"nope": np.ones(1)}, "--const-input names unknown inputs"),
        ({"starts": "1.5"}, "values of dtype float64 for a i64 input"),
        ({"starts": "a,b"}, "expected a .npy file or numbers"),
    ):
        with pytest.raises(PackError, match=needle):
            pack(path, tmp_path / "b.epk", constant_inputs=bad)
