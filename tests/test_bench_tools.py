"""The benchmark helpers whose figures the docs quote: bench_peak.py's multiply-add
count (checked against counts done by hand) and vcpu_probe.py's placement rule."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def _model(path):
    """x [1,8,10,10] -> 3x3 conv to 16, stride 2, pad 1 -> depthwise 3x3 (group 16)
    -> global pool -> Gemm to 5 (transB)."""
    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w1"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         group=16),
        helper.make_node("GlobalAveragePool", ["b"], ["c"]),
        helper.make_node("Flatten", ["c"], ["d"]),
        helper.make_node("Gemm", ["d", "w2"], ["y"], transB=1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [init("w0", (16, 8, 3, 3)), init("w1", (16, 1, 3, 3)), init("w2", (5, 16))],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_model_macs_counts_convs_grouped_convs_and_linears(tmp_path):
    from bench_peak import model_macs

    _model(tmp_path / "m.onnx")
    conv = 5 * 5 * 16 * (8 * 3 * 3)  # 5x5 outputs of 16 channels, 72 taps each
    dw = 5 * 5 * 16 * 9  # one input channel per output channel
    gemm = 5 * 16
    assert model_macs(tmp_path / "m.onnx") == conv + dw + gemm


@pytest.mark.parametrize(
    "rt_ns, share, want",
    [(90.0, 1.95, "near"), (340.0, 1.9, "far"), (63.0, 1.0, "shared"),
     (340.0, 1.2, "shared"), (220.0, 1.9, "?"), (90.0, math.nan, "near")],
)  # fmt: skip
def test_placement_puts_one_cores_arithmetic_before_the_round_trip(rt_ns, share, want):
    from vcpu_probe import placement

    assert placement(rt_ns, share) == want
