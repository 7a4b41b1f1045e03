"""The edgepack command as a user runs it: build, run, info, bench, and its errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import bench_rounds, cli_env, load
from onnx import TensorProto, helper

pytestmark = pytest.mark.cpu


def ep(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=cli_env(),
    )
    if ok:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory, digits_onnx):
    d = tmp_path_factory.mktemp("cli")
    r = ep("build", digits_onnx, "-o", d / "digits.epk", "--quant", "int8")
    assert "[6/6]" in r.stdout and "end-to-end logits" in r.stdout
    return d / "digits.epk"


@pytest.fixture(scope="module")
def digit_image():
    import train_digits

    _, x_test, _, y_test = train_digits.load_split()
    return x_test[:1], int(y_test[0])


def test_help_on_every_command():
    for cmd in ([], ["build"], ["run"], ["info"], ["bench"]):
        r = ep(*cmd, "--help")
        assert "usage: edgepack" in r.stdout


def test_run_prints_prediction_and_writes_npz(tmp_path, digits_bundle, digit_image):
    x, label = digit_image
    np.save(tmp_path / "x.npy", x)
    r = ep("run", digits_bundle, "--input", tmp_path / "x.npy")
    assert f"prediction: class {label}" in r.stdout
    ep("run", digits_bundle, "--input", tmp_path / "x.npy", "--output", tmp_path / "y.npz")
    with np.load(tmp_path / "y.npz") as y:
        assert y.files == ["logits"]
        np.testing.assert_array_equal(y["logits"], load(digits_bundle).run({"image": x})["logits"])
    np.savez(tmp_path / "x.npz", image=x)
    r = ep("run", digits_bundle, "--input", tmp_path / "x.npz", "--threads", "1")
    assert f"prediction: class {label}" in r.stdout


def test_info_shows_model_arena_and_error_table(digits_bundle):
    out = ep("info", digits_bundle).stdout
    for needle in (
        "input     image: f32[1x1x8x8]",
        "output    logits: f32[1x10]",
        "arena:",
        "params:",
        "quant:    int8",
        "rel L2",
        "end-to-end logits",
    ):
        assert needle in out, needle


def test_bench_reports_median_and_p99(digits_bundle):
    out = ep("bench", digits_bundle, "-n", "20", "--warmup", "2", "--threads", "1").stdout
    assert "median" in out and "p99" in out


def test_bench_rounds_answer_a_benchmark_driver(tmp_path, digits_bundle, digit_image):
    x, _ = digit_image
    np.save(tmp_path / "x.npy", x)
    cmd = [sys.executable, "-m", "edgepack.cli", "bench", str(digits_bundle), "--rounds",
           "--input", str(tmp_path / "x.npy"), "--threads", "1"]  # fmt: skip
    got = bench_rounds(cmd, tmp_path, env=cli_env())
    assert list(got) == ["logits"]
    np.testing.assert_array_equal(got["logits"], load(digits_bundle).run({"image": x})["logits"])


def test_bench_and_run_a_model_with_int64_and_bool_inputs(tmp_path):
    # token ids (int64) into an embedding Gather, a bool mask into Where: bench makes
    # inputs of each input's own dtype, run takes them from an npz
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]),
         helper.make_node("Where", ["keep", "e", "zero"], ["y"])],
        "t",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
         helper.make_tensor_value_info("keep", TensorProto.BOOL, [1, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(table, "table"),
         onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "ids.onnx")
    ep("build", str(tmp_path / "ids.onnx"), "-o", str(tmp_path / "ids.epk"))
    out = ep("bench", str(tmp_path / "ids.epk"), "-n", "5", "--warmup", "1").stdout
    assert "median" in out
    np.savez(tmp_path / "in.npz", ids=np.array([[3, -1, 0]], np.int64),
             keep=np.array([[[True], [True], [False]]]))  # fmt: skip
    ep("run", str(tmp_path / "ids.epk"), "--input", str(tmp_path / "in.npz"), "--output",
       str(tmp_path / "out.npz"))  # fmt: skip
    with np.load(tmp_path / "out.npz") as got:
        assert np.array_equal(got["y"], [[table[3], table[9], np.zeros(4)]])


@pytest.mark.parametrize(
    "feeds,needle",
    [
        ({"img": np.zeros((1, 1, 8, 8), np.float32)}, "unknown: img; missing: image"),
        ({"image": np.zeros((1, 1, 8, 9), np.float32)}, "has shape [1, 1, 8, 9]"),
        ({"image": np.zeros((1, 1, 8, 8), np.float64)}, "has dtype float64"),
    ],
)
def test_run_with_wrong_input_lists_expected_inputs(tmp_path, digits_bundle, feeds, needle):
    np.savez(tmp_path / "bad.npz", **feeds)
    r = ep("run", digits_bundle, "--input", tmp_path / "bad.npz", ok=False)
    assert r.returncode == 1
    assert needle in r.stderr and "expected: image f32[1x1x8x8]" in r.stderr


def test_corrupt_bundle_is_refused(tmp_path, digits_bundle):
    data = bytearray(digits_bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "c.epk").write_bytes(bytes(data))
    np.save(tmp_path / "x.npy", np.zeros((1, 1, 8, 8), np.float32))
    for cmd in ("run", "info", "bench"):
        args = ["--input", tmp_path / "x.npy"] if cmd == "run" else []
        r = ep(cmd, tmp_path / "c.epk", *args, ok=False)
        assert r.returncode == 1
        assert "not a valid edgepack bundle: weight checksum mismatch" in r.stderr
        assert "Traceback" not in r.stderr


def test_unsupported_op_fails_the_build(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Det", ["x"], ["y"], name="volume")],
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "gs.onnx"
    )
    r = ep("build", tmp_path / "gs.onnx", "-o", tmp_path / "g.epk", ok=False)
    assert r.returncode == 1
    assert "op Det at node 'volume'" in r.stderr and "Supported ops: " in r.stderr
    assert not (tmp_path / "g.epk").exists()


def test_max_error_fails_the_build(tmp_path, digits_onnx):
    r = ep(
        "build",
        digits_onnx,
        "-o",
        tmp_path / "q.epk",
        "--quant",
        "int8",
        "--max-error",
        "1e-6",
        ok=False,
    )
    assert r.returncode == 1 and "exceeds --max-error 1e-06" in r.stderr
    assert not (tmp_path / "q.epk").exists()


def test_missing_files_give_clear_errors(tmp_path, digits_bundle):
    r = ep("run", tmp_path / "nope.epk", "--input", tmp_path / "x.npy", ok=False)
    assert r.returncode == 1 and "cannot read bundle" in r.stderr
    r = ep("run", digits_bundle, "--input", tmp_path / "nope.npy", ok=False)
    assert r.returncode == 1 and "no such file" in r.stderr
    r = ep("build", tmp_path / "nope.onnx", "-o", tmp_path / "o.epk", ok=False)
    assert r.returncode == 1 and "nope.onnx" in r.stderr


def test_int4_build_records_group_size_and_its_weights(tmp_path, digits_onnx, digit_image):
    out = tmp_path / "q4.epk"
    r = ep("build", digits_onnx, "-o", out, "--quant", "int4", "--group-size", "64",
           "--quant-min-weights", "0")
    assert "end-to-end logits" in r.stdout
    m = load(out).manifest
    assert m["quantization"]["mode"] == "int4" and m["quantization"]["group_size"] == 64
    nodes = {n["name"]: n for n in m["graph"]["nodes"]}
    fc = nodes["fc10"]  # linear 32 -> 64: K = 32 padded to one group of 64
    assert fc["kernel"]["dtype"] == "i4" and fc["attrs"]["wshape"] == [64, 32]
    w, s = (m["weights"][fc["inputs"][i]] for i in (1, 3))
    assert (w["dtype"], w["shape"], s["dtype"], s["shape"]) == ("i4", [64, 32], "f16", [64, 1])
    assert "weights:  i4 " in ep("info", out).stdout
    np.save(tmp_path / "x.npy", digit_image[0])
    assert "prediction" in ep("run", out, "--input", tmp_path / "x.npy").stdout
    r = ep("build", digits_onnx, "-o", tmp_path / "x.epk", "--quant", "int3", ok=False)
    assert r.returncode == 2 and "int4" in r.stderr  # the choices come from the table
