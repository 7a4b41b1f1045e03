"""schemathesis against ``/openapi.json`` of ``edgepack serve --http``: requests made
from the document (valid and invalid ones) get no 5xx, only statuses the document
lists, and bodies that match it. For a tensor bundle (KServe v2) and a language model
(the OpenAI routes), both with an API key."""

from __future__ import annotations

import httpx
import mqtt_broker as mb
import pytest
from hypothesis import HealthCheck, settings
from test_http import _serve

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.http

KEY = "schema-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _schema_of(url: str):
    doc = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    schema = schemathesis.openapi.from_dict(doc)
    return schema


@pytest.fixture(scope="module")
def tensor_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema-tensor")
    b = mb.digits_bundle(tmp_path_factory.getbasetemp(), 4)
    try:
        _, url = _serve(b, d, "schema-t", "--model", "digits4", "--api-key", KEY,
                        "--max-wait-ms", "0")  # fmt: skip
        yield url
    finally:
        mb.cleanup()


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory):
    pytest.importorskip("torch")
    from edgepack.packager.llm.build import build_llm
    from test_openai_api import _llama_folder

    d = tmp_path_factory.mktemp("schema-llm")
    _, _, hf = _llama_folder(d)
    build_llm(hf, d / "t.epk", ctx=64, chunk=8, kv="f32", slots=4, log=lambda s: None)
    try:
        _, url = _serve(d / "t.epk", d, "schema-l", "--model", "tiny", "--api-key", KEY,
                        "--max-tokens", "8")  # fmt: skip
        yield url
    finally:
        mb.cleanup()


FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
tensor_lazy = schemathesis.pytest.from_fixture("tensor_schema")
llm_lazy = schemathesis.pytest.from_fixture("llm_schema")


@pytest.fixture(scope="module")
def tensor_schema(tensor_server):
    return _schema_of(tensor_server)


@pytest.fixture(scope="module")
def llm_schema(llm_server):
    return _schema_of(llm_server)


@tensor_lazy.parametrize()
@FAST
def test_tensor_server_follows_its_openapi_document(case, tensor_server):
    case.call_and_validate(base_url=tensor_server, headers=AUTH)


@llm_lazy.parametrize()
@FAST
def test_llm_server_follows_its_openapi_document(case, llm_server):
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    # A schema-valid prompt can still be longer than the model's context (a token count
    # no schema can state): that is a documented 400 (context_length_exceeded), so the
    # "valid data is accepted" check does not apply; every other check does.
    case.call_and_validate(base_url=llm_server, headers=AUTH,
                           excluded_checks=[positive_data_acceptance])  # fmt: skip
