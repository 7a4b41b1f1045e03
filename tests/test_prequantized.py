"""Pre-quantized models as ONNX Runtime's own quantizer writes them, through the
bundle, against ONNX Runtime running the same quantized file:

- static QDQ (QuantizeLinear / DequantizeLinear pairs, per-channel int8 weights, uint8
  activations: ``quantize_static``, QuantFormat.QDQ);
- static QOperator (QLinearConv, MaxPool of uint8 tensors: QuantFormat.QOperator), on
  a conv net of standard ops (ORT writes its Gemm and GlobalAveragePool as com.microsoft
  contrib ops, which are refused by name);
- dynamic (DynamicQuantizeLinear + MatMulInteger: ``quantize_dynamic``).

The digits CNN (tests/data) is the model; its test images the inputs. ORT runs these
files on integer kernels whose rounding differs from the operator text edgepack
follows by a quantization step here and there, so the check is agreement (cosine of
the logits, top-1) rather than equality; each quantized bundle must also stay as
accurate as the float model within a point.

Static models are quantized with ``reduce_range`` (7-bit weights) for the comparison
with ORT's integer kernels: on a CPU without VNNI (AVX2 only) ORT multiplies u8 by s8
with ``vpmaddubsw``, whose int16 pair sums saturate for 8-bit weights, and its output
then drifts from the operator text (the digits QDQ model: cosine 0.9948, max error
0.87 on a Zen 3). ORT's own documentation recommends ``reduce_range`` there. With full
8-bit weights the check is against ORT running the operator text itself (graph
optimisations off: DequantizeLinear, then float ops), which edgepack follows exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load, ort_run, pack

pytestmark = pytest.mark.cpu
quantization = pytest.importorskip("onnxruntime.quantization")


@pytest.fixture(scope="module")
def digits_data():
    import train_digits

    _, x_test, _, y_test = train_digits.load_split()
    return x_test[:200].astype(np.float32), y_test[:200]


def _fixed_batch(src, dst, batch: int):
    """The digits model with its batch fixed (ORT's quantizer wants static shapes)."""
    import onnx

    m = onnx.load(src)
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.save(m, dst)
    return dst


def _quantized(tmp_path, digits_onnx, x, kind: str, reduce_range: bool = True):
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_dynamic,
        quantize_static,
    )

    src = _fixed_batch(digits_onnx, tmp_path / "digits.onnx", len(x))
    pre, out = tmp_path / "pre.onnx", tmp_path / f"digits_{kind}.onnx"
    quant_pre_process(str(src), str(pre))
    if kind == "dynamic":
        quantize_dynamic(str(pre), str(out), weight_type=QuantType.QInt8)
        return out

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"image": x}])

        def get_next(self):
            return next(self.it, None)

    fmt = QuantFormat.QDQ if kind == "qdq" else QuantFormat.QOperator
    quantize_static(str(pre), str(out), Reader(), quant_format=fmt, per_channel=True,
                    reduce_range=reduce_range, weight_type=QuantType.QInt8,
                    activation_type=QuantType.QUInt8)  # fmt: skip
    return out


def _cos(a, b) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("kind", ["qdq", "dynamic"])
def test_onnx_runtime_quantized_models_run_as_onnx_runtime_runs_them(
    tmp_path, digits_onnx, digits_data, kind
):
    import onnx

    x, y = digits_data
    path = _quantized(tmp_path, digits_onnx, x, kind)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    wanted = {"qdq": {"QuantizeLinear", "DequantizeLinear"},
              "qoperator": {"QLinearConv"}, "dynamic": {"DynamicQuantizeLinear"}}[kind]  # fmt: skip
    assert wanted <= ops, ops
    got = load(pack(path, tmp_path / "q.epk")).run({"image": x})["logits"]
    (ref,) = ort_run(path, {"image": x})
    assert _cos(got, ref) >= 0.999
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.98
    (fp,) = ort_run(digits_onnx, {"image": x})
    acc, acc_fp = (got.argmax(1) == y).mean(), (fp.argmax(1) == y).mean()
    assert acc >= acc_fp - 0.01, (acc, acc_fp)


def test_an_8_bit_qdq_model_runs_as_its_operator_text(tmp_path, digits_onnx, digits_data):
    """Full 8-bit weights (no reduce_range): ORT with graph optimisations off runs the
    QDQ pairs as written (dequantize, float conv), the semantics edgepack implements."""
    x, _ = digits_data
    path = _quantized(tmp_path, digits_onnx, x, "qdq", reduce_range=False)
    got = load(pack(path, tmp_path / "q.epk")).run({"image": x})["logits"]
    (ref,) = ort_run(path, {"image": x}, optimize=False)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def _conv_net(path):
    """Conv, Relu, MaxPool, Conv, Relu, Flatten: QOperator-quantizable with standard ops."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((6, 1, 3, 3)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((4, 6, 3, 3)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Flatten", ["r2"], ["logits"]),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("w1", w1), ("b1", rng.standard_normal(6).astype(np.float32) * 0.1),
        ("w2", w2), ("b2", rng.standard_normal(4).astype(np.float32) * 0.1))]  # fmt: skip
    g = helper.make_graph(nodes, "convnet",
                          [helper.make_tensor_value_info("image", TensorProto.FLOAT, [8, 1, 8, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                          inits)  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, path)
    return path


def test_a_qoperator_model_runs_as_onnx_runtime_runs_it(tmp_path, digits_data):
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    x = digits_data[0][:8]
    src = _conv_net(tmp_path / "convnet.onnx")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"image": digits_data[0][8:16]}])

        def get_next(self):
            return next(self.it, None)

    out = tmp_path / "convnet_qop.onnx"
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QOperator,
                    per_channel=True, reduce_range=True, weight_type=QuantType.QInt8,
                    activation_type=QuantType.QUInt8)  # fmt: skip
    ops = {n.op_type for n in onnx.load(out).graph.node}
    assert {"QLinearConv", "QuantizeLinear", "DequantizeLinear"} <= ops, ops
    got = load(pack(out, tmp_path / "q.epk")).run({"image": x})["logits"]
    (ref,) = ort_run(out, {"image": x})
    # ORT's integer convolution requantizes with its own rounding: a step apart at most
    step = float(np.abs(np.diff(np.unique(ref))).min())
    assert np.abs(got - ref).max() <= 1.01 * step and _cos(got, ref) >= 0.999


def test_contrib_quantized_ops_are_refused_by_name(tmp_path, digits_onnx, digits_data):
    from edgepack.packager.ir import PackError

    path = _quantized(tmp_path, digits_onnx, digits_data[0], "qoperator")
    with pytest.raises(PackError, match="QGemm|QLinearGlobalAveragePool"):
        pack(path, tmp_path / "q.epk")
