"""OpenAI's ``POST /v1/embeddings`` for a text-encoder bundle (one packed with
``--tokenizer``; runtime/embed.py), beside its KServe v2 routes (docs/http.md).

Each request's texts (or token-id lists) become the rows of one tensor job on the
shared scheduler, so they batch with v2 and MQTT jobs and count against the same
queue; the vectors are pooled from the job's output and answered as float lists or,
with ``encoding_format: base64`` (what the ``openai`` Python client asks for by
default), as base64 of little-endian float32.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from ..text import TextError
from .openai_api import Int, model_list
from .sched import BadInput

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # user, ...

    model: str = Field(..., description="any name: the server serves one model")
    input: str | list[str] | list[Int] | list[list[Int]] = Field(
        ..., description="a text, texts, one token-id list, or token-id lists"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1, description="the model's own size only")


def add_routes(app: FastAPI, service, http_error: type[Exception],
               run_job: Callable[[list, int, str], Awaitable]) -> None:  # fmt: skip
    """/v1/models and /v1/embeddings of ``service`` (a Service whose bundle has a text
    encoder); ``run_job(arrays, rows, id)`` runs a tensor job and returns it done."""
    enc, name = service.encoder, service.model
    model_list(app, name)

    @app.post("/v1/embeddings", summary="OpenAI: embeddings of texts or token ids")
    async def embeddings(r: EmbeddingRequest):
        items = [r.input] if isinstance(r.input, str) else r.input
        if not items:
            raise http_error("invalid_job", "input: give at least one text or token id")
        if len(items) > MAX_INPUTS:
            raise http_error("invalid_job", f"input: at most {MAX_INPUTS} items per request")
        if r.dimensions is not None and r.dimensions != enc.dimensions:
            raise http_error("invalid_job", f"dimensions {r.dimensions}: this model's "
                                            f"embeddings have {enc.dimensions}")  # fmt: skip
        try:
            if isinstance(items[0], str):
                seqs = enc.tokenize(items)
            else:
                seqs = [items] if isinstance(items[0], int) else items
            enc.check(seqs)
            feeds = enc.feeds(seqs)
            arrays, rows = service.sched.prepare(feeds)
        except (TextError, BadInput) as e:
            raise http_error("bad_input", str(e)) from None
        job = await run_job(arrays, rows, f"emb-{uuid.uuid4().hex[:24]}")
        vecs = enc.pool(job.outputs[enc.output], feeds[enc.mask_name])
        if r.encoding_format == "base64":
            out = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vecs]
        else:
            out = [v.tolist() for v in vecs]
        used = sum(len(s) for s in seqs)
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e}
                     for i, e in enumerate(out)],  # fmt: skip
            "model": name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
