"""Whole models through the bundle against ONNX Runtime (the reference).

Thresholds are the acceptance points of the core issue: digits fp32 within 1e-4 and
int8 accuracy within 1 point; ResNet-18 / MobileNetV2 fp32 within 1e-3 relative and
int8 cosine >= 0.99; the real rapidocr classifier fp32 equal and int8 top-1 agreement
>= 95 % on 200 seeded inputs. int4 and bf16 (the weight-type table's new rows) take the
same paths with thresholds a little under what was measured when they landed (int4:
digits accuracy unchanged; random-weight ResNet-18 cosine 0.989, MobileNetV2 0.984 with
its input-dependent part 0.85; the classifier's top-1 agreement 171/200 at group 32,
its 1x1 convs reduce over 8-96 channels).
"""

from __future__ import annotations

import numpy as np
import pytest
import text_lines
from conftest import load, ort_run, pack

pytestmark = pytest.mark.cpu


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def digits_split():
    import train_digits

    return train_digits.load_split()


def test_digits_fp32_matches_ort(tmp_path, digits_onnx, digits_split):
    _, x_test, _, _ = digits_split
    batch = x_test[:64]
    b = pack(digits_onnx, tmp_path / "d.epk", input_shapes={"image": batch.shape})
    got = load(b).run({"image": batch})["logits"]
    (ref,) = ort_run(digits_onnx, {"image": batch})
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("quant", ["int8", "int4", "bf16"])
def test_digits_quantized_accuracy_within_one_point(tmp_path, digits_onnx, digits_split, quant):
    x_train, x_test, _, y_test = digits_split
    shape = {"image": x_test.shape}
    np.savez(tmp_path / "calib.npz", image=x_train[:64])
    fp = load(pack(digits_onnx, tmp_path / "f.epk", input_shapes=shape))
    q = load(
        pack(
            digits_onnx,
            tmp_path / "q.epk",
            input_shapes=shape,
            quant=quant,
            calib=tmp_path / "calib.npz",
        )
    )
    acc_fp = float((fp.run({"image": x_test})["logits"].argmax(1) == y_test).mean())
    acc_q = float((q.run({"image": x_test})["logits"].argmax(1) == y_test).mean())
    assert acc_fp > 0.95, acc_fp
    assert acc_q >= acc_fp - 0.01, (acc_fp, acc_q)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_cnn_fp32_matches_ort(tmp_path, model_dir, name):
    onnx_path = model_dir / f"{name}.onnx"
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    got = load(pack(onnx_path, tmp_path / "m.epk")).run({"input": x})["logits"]
    (ref,) = ort_run(onnx_path, {"input": x})
    assert _rel(got, ref) < 1e-3
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


# (cosine, cosine of the input-dependent part) each mode must reach
CNN_COSINE = {"int8": (0.99, 0.95), "fp16": (0.9999, 0.999), "bf16": (0.9995, 0.995),
              "int4": (0.97, 0.8)}


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("quant", list(CNN_COSINE))
def test_cnn_quantized_close_to_ort(tmp_path, model_dir, name, quant):
    onnx_path = model_dir / f"{name}.onnx"
    x = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    got = load(pack(onnx_path, tmp_path / "q.epk", quant=quant)).run({"input": x})["logits"]
    (ref,) = ort_run(onnx_path, {"input": x})
    # The random-weight logits share a large input-independent part; compare the
    # input-dependent part too so the check cannot pass on that alone.
    whole, varying = CNN_COSINE[quant]
    assert _cos(got, ref) >= whole
    (ref_b,) = ort_run(onnx_path, {"input": np.zeros_like(x)})
    assert _cos(got - ref_b, ref - ref_b) >= varying


@pytest.fixture(scope="module")
def rapidocr_cls():
    import model_sources

    try:
        return model_sources.rapidocr_cls_model()
    except FileNotFoundError as e:
        pytest.fail(f"test requirement missing: {e}")


def test_rapidocr_classifier_fp32_and_int8(tmp_path, rapidocr_cls):
    shape = {"x": (1, 3, 48, 192)}
    fp = load(pack(rapidocr_cls, tmp_path / "f.epk", input_shapes=shape))
    q = load(pack(rapidocr_cls, tmp_path / "q.epk", input_shapes=shape, quant="int8"))
    xs = text_lines.noise_bars(200, seed=0)
    out = fp.outputs[0]["name"]
    agree = 0
    for i in range(len(xs)):
        feed = {"x": xs[i : i + 1]}
        y = fp.run(feed)[out]
        if i < 20:
            (ref,) = ort_run(rapidocr_cls, feed)
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
        agree += int(q.run(feed)[out].argmax() == y.argmax())
    assert agree >= 190, f"int8 top-1 agrees with fp32 on {agree}/200"


# Top-1 agreement with fp32 on 200 lines, int8 x int8 convs (packager/act_quant.py)
# calibrated on 16 lines of another seed. Measured (tests/text_lines.py says what the
# kinds are): rendered text 200/200 (ONNX Runtime's QDQ model calibrated on the same
# lines: 200), noise+bars near-ties 194/200 (ORT QDQ: 182). Issue 21 asks 198.
@pytest.mark.parametrize(("kind", "least"), [("rendered", 198), ("noise_bars", 190)])
def test_rapidocr_classifier_int8_activations_with_calibration(
    tmp_path, rapidocr_cls, kind, least
):
    lines = text_lines.KINDS[kind]
    shape = {"x": (1, 3, 48, 192)}
    np.savez(tmp_path / "calib.npz", x=lines(16, seed=1))
    fp = load(pack(rapidocr_cls, tmp_path / "f.epk", input_shapes=shape))
    q = load(pack(rapidocr_cls, tmp_path / "q.epk", input_shapes=shape, quant="int8",
                  calib=tmp_path / "calib.npz", act_quant="int8"))  # fmt: skip
    assert q.manifest["quantization"]["activations"]["convs"] > 0
    xs = lines(200, seed=0)
    out = fp.outputs[0]["name"]
    ys = np.stack([fp.run({"x": x[None]})[out][0].argmax() for x in xs])
    if kind == "rendered":  # the classifier reads them (measured 198/200 right)
        right = int((ys == np.arange(len(xs)) % 2).sum())
        assert right >= 195, f"fp32 reads the direction of {right}/200 rendered lines"
    agree = sum(int(q.run({"x": x[None]})[out].argmax() == y) for x, y in zip(xs, ys))
    assert agree >= least, f"int8 x int8 top-1 agrees with fp32 on {agree}/200 {kind}"


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_cnn_int8_activations_close_to_ort(tmp_path, model_dir, name):
    """--quant int8 with --calib: the convs take u8 activations, and the tensors only
    int8 convs read pass between them as u8 codes (MobileNetV2's depthwise convs write
    the codes of the projections after them); cosine with ONNX Runtime's fp32 >= 0.99
    (and 0.95 for the input-dependent part)."""
    onnx_path = model_dir / f"{name}.onnx"
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((4, 3, 224, 224)).astype("f4"))
    q = load(pack(onnx_path, tmp_path / "q.epk", quant="int8", calib=tmp_path / "calib.npz",
                  min_cosine=0, act_quant="int8"))  # fmt: skip
    assert q.manifest["quantization"]["activations"]["convs"] > 0
    graph = q.manifest["graph"]
    codes = [t for t, v in graph["tensors"].items() if v["dtype"] == "u8"]
    # (MobileNetV2's: 22, of which the 16 inside its banded chains are never tensors)
    assert len(codes) >= {"resnet18": 8, "mobilenet_v2": 6}[name], codes
    if name == "mobilenet_v2":
        # 17 depthwise convs write codes: the 16 after an expansion in chains run in
        # bands (packager/mbconv.py), the first (no expansion, 288 weights: also int8,
        # packager/quantize.py INT8_ACT_MIN_MACS) on its own
        made = [n["op"] for n in graph["nodes"]]
        assert (made.count("qdwconv"), made.count("qmbconv")) == (1, 16)
        assert "conv" not in made and "mbconv" not in made  # every conv computes int8
    x = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    got = q.run({"input": x})["logits"]
    (ref,) = ort_run(onnx_path, {"input": x})
    assert _cos(got, ref) >= 0.99
    (ref_b,) = ort_run(onnx_path, {"input": np.zeros_like(x)})
    assert _cos(got - ref_b, ref - ref_b) >= 0.95


@pytest.mark.parametrize(("quant", "least"), [("int4", 160), ("bf16", 198)])
def test_rapidocr_classifier_int4_and_bf16(tmp_path, rapidocr_cls, quant, least):
    shape = {"x": (1, 3, 48, 192)}
    fp = load(pack(rapidocr_cls, tmp_path / "f.epk", input_shapes=shape))
    q = load(pack(rapidocr_cls, tmp_path / "q.epk", input_shapes=shape, quant=quant))
    wanted = {"int4": "i4", "bf16": "bf16"}[quant]
    assert wanted in {n["kernel"]["dtype"] for n in q.manifest["graph"]["nodes"]}
    out = fp.outputs[0]["name"]
    xs = text_lines.noise_bars(200, seed=0)
    agree = sum(
        int(q.run({"x": xs[i : i + 1]})[out].argmax() == fp.run({"x": xs[i : i + 1]})[out].argmax())
        for i in range(len(xs))
    )
    assert agree >= least, f"{quant} top-1 agrees with fp32 on {agree}/200"


@pytest.mark.parametrize(("kind", "shape"), [("det", (1, 3, 640, 640)), ("rec", (1, 3, 48, 320))])
def test_pp_ocrv4_detector_and_recogniser(tmp_path, kind, shape):
    """PP-OCRv4 as rapidocr ships it (paddle2onnx, opset 12): the detector needs Resize
    and ConvTranspose, the recogniser Pow, Sqrt, runtime MatMuls and Slices. fp32 within
    1e-4 of ONNX Runtime; int8 packed with four calibration pages (--calib), which
    keeps the layers its quantization hurts most in fp32 (--min-cosine 0.99): output
    cosine >= 0.99 on other seeded text-like pages."""
    import model_sources

    try:
        path = model_sources.rapidocr_model(kind)
    except FileNotFoundError as e:
        pytest.fail(f"test requirement missing: {e}")
    fp = load(pack(path, tmp_path / "f.epk", input_shapes={"x": shape}))
    pages = np.random.default_rng(11)
    calib = tmp_path / "pages.npz"
    np.savez(calib, x=np.concatenate([model_sources.text_page(pages, shape) for _ in range(4)]))
    q = load(pack(path, tmp_path / "q.epk", input_shapes={"x": shape}, quant="int8",
                  calib=calib))  # fmt: skip
    assert q.manifest["quantization"]["kept_fp32"]  # all-int8 measured 0.984 / 0.989
    out = fp.outputs[0]["name"]
    rng = np.random.default_rng(3)
    for _ in range(2):
        x = model_sources.text_page(rng, shape)
        (ref,) = ort_run(path, {"x": x})
        if kind == "det":  # the page has text the detector finds
            assert ref.max() > 0.9 and (ref > 0.3).mean() > 0.02
        y = fp.run({"x": x})[out]
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        # measured 0.997 / 0.996 (det, 2 layers kept, 46 KB) and 0.995 (rec, 13, 2.6 MB)
        assert _cos(q.run({"x": x})[out], ref) >= 0.99




@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_an_all_nan_or_inf_input_gives_nan_as_onnx_runtime(tmp_path, digits_onnx, value):
    # conv + ReLU epilogues, max pooling, global average pooling, linear: none may turn a
    # NaN into a plausible logit (the ReLU and the max pool had dropped it)
    s = load(pack(digits_onnx, tmp_path / "d.epk"))
    name = s.inputs[0]["name"]
    x = np.full(s.inputs[0]["shape"], value, np.float32)
    got = s.run({name: x})[s.outputs[0]["name"]]
    (ref,) = ort_run(digits_onnx, {name: x})
    assert np.isnan(ref).all() and np.array_equal(np.isnan(got), np.isnan(ref))


def test_a_vit_exported_by_torch_onnx(tmp_path):
    """A ViT classifier from a transformers config (random weights, seeded), exported
    by torch.onnx as a user would: patch Conv, class token (Expand of a constant,
    Gather of row 0), LayerNormalization, MatMuls of run-time operands, Softmax, Erf
    GELU. fp32 within 1e-4 of ONNX Runtime, int8 cosine >= 0.99."""
    import model_sources

    path = model_sources.vit_onnx(tmp_path / "vit.onnx")
    fp = load(pack(path, tmp_path / "f.epk"))
    q = load(pack(path, tmp_path / "q.epk", quant="int8", min_weights=0))
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        (ref,) = ort_run(path, {"pixel_values": x})
        got = fp.run({"pixel_values": x})["logits"]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        assert _cos(q.run({"pixel_values": x})["logits"], ref) >= 0.99


def test_a_bert_encoder_with_int64_token_ids_and_a_mask(tmp_path):
    """A BERT-style encoder from a transformers config (random weights, seeded) exported
    by torch.onnx: int64 token ids and attention mask as graph inputs, the embedding
    lookups as Gather at run-time indices, the mask through Cast / Where / compare
    chains. Within 1e-4 of ONNX Runtime, and the mask changes the answer."""
    import warnings

    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    bert = BertModel(cfg).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    path = tmp_path / "bert.onnx"
    ids = torch.randint(0, 120, (1, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {"input_names": ["input_ids", "attention_mask"], "output_names": ["hidden"]}
        torch.onnx.export(Encoder(), (ids, torch.ones_like(ids)), str(path), opset_version=17,
                          dynamo=False, **names)  # fmt: skip
    s = load(pack(path, tmp_path / "b.epk"))
    assert [i["dtype"] for i in s.inputs] == ["i64", "i64"]
    rng = np.random.default_rng(1)
    outs = []
    for pad in (0, 4):
        feed = {"input_ids": rng.integers(0, 120, (1, 12)).astype(np.int64),
                "attention_mask": np.ones((1, 12), np.int64)}  # fmt: skip
        feed["attention_mask"][0, 12 - pad :] = 0
        (ref,) = ort_run(path, feed)
        got = s.run(feed)["hidden"]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        outs.append((feed, got))
    feed, masked = outs[1]
    unmasked = s.run({**feed, "attention_mask": np.ones((1, 12), np.int64)})["hidden"]
    assert not np.allclose(masked[0, :8], unmasked[0, :8], atol=1e-3)  # the mask is honoured


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_recurrent_sequence_model_exported_by_torch(tmp_path, kind):
    """A small sequence tagger from torch (1-D conv front end, two bidirectional
    recurrent layers batch-first, a linear head) exported by torch.onnx, returning the
    per-step logits and the final states (Y_h, and Y_c for the LSTM): ONNX's LSTM /
    GRU / RNN nodes, layout and direction included. fp32 within 1e-4 of ONNX Runtime,
    int8 cosine >= 0.99 (the recurrent weights stay float32)."""
    import model_sources

    path, names = model_sources.recurrent_onnx(kind, tmp_path / f"{kind}.onnx")
    fp = load(pack(path, tmp_path / "f.epk"))
    q = load(pack(path, tmp_path / "q.epk", quant="int8", min_weights=0))
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal((2, 6, 20)).astype(np.float32)
        refs = ort_run(path, {"x": x})
        got = fp.run({"x": x})
        for name, ref in zip(names, refs):
            atol = 1e-4 * float(np.abs(ref).max())
            np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=atol)
        assert _cos(q.run({"x": x})["logits"], refs[0]) >= 0.99


def test_a_whisper_tiny_sized_audio_encoder(tmp_path):
    """Whisper's encoder at whisper-tiny's size (80 mel bins x 3000 frames, two 1-D
    convs, the second with stride 2, then 4 pre-norm attention layers of width 384 over
    1500 positions) from a transformers config with random weights (seeded), exported
    by torch.onnx. fp32 within 1e-4 of ONNX Runtime, int8 cosine >= 0.99."""
    import model_sources

    path = model_sources.whisper_encoder_onnx(tmp_path / "whisper_encoder.onnx")
    x = np.random.default_rng(0).standard_normal((1, 80, 3000)).astype(np.float32)
    (ref,) = ort_run(path, {"mel": x})
    got = load(pack(path, tmp_path / "f.epk")).run({"mel": x})["hidden"]
    assert got.shape == (1, 1500, 384)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    # two calibration inputs: the error table runs both graphs once for each
    np.savez(tmp_path / "calib.npz", mel=np.random.default_rng(1).standard_normal((2, 80, 3000)))
    q = load(pack(path, tmp_path / "q.epk", quant="int8", calib=tmp_path / "calib.npz"))
    q = q.run({"mel": x})["hidden"]
    assert _cos(q, ref) >= 0.99
