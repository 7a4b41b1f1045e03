"""The HTTP front of ``edgepack serve`` (``--http HOST:PORT``): the Open Inference
Protocol (KServe v2 REST, which Triton and KServe speak) for every bundle, health,
Prometheus metrics and the OpenAPI document (docs/http.md).

FastAPI on uvicorn: the OpenAPI document comes from the routes themselves, and both are
pure Python over small compiled wheels (pydantic-core, httptools optional) that exist
for aarch64, so they go into the device executable. Jobs go to the same ``Service`` as
the MQTT agent's (one queue, one batcher, one set of limits); the tensors are read and
written by the protocol codec (runtime/serve/codec.py), with its checks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from .codec import CodecError, kserve_datatype, loads_json, tensors_from_kserve, tensors_to_kserve
from .embeddings_api import add_routes as add_embedding_routes
from .openai_api import add_routes as add_openai_routes
from .sched import BadInput, Job
from .service import LLMService, Service

log = logging.getLogger("edgepack.http")

# Protocol error codes (docs/protocol.md) as HTTP statuses.
STATUS = {
    "malformed": 400,
    "invalid_job": 400,
    "bad_input": 400,
    "unsupported": 400,
    "unauthorized": 401,
    "not_found": 404,
    "too_large": 413,
    "busy": 429,
    "context_length_exceeded": 400,
    "cancelled": 499,
    "internal": 500,
    "shutting_down": 503,
    "deadline_exceeded": 504,
}
HEADER_LENGTH = "inference-header-content-length"  # the binary-data extension
PUBLIC = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})  # no key needed


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()  # Bearer keys; empty: no authentication
    tls_cert: str | None = None
    tls_key: str | None = None


class HttpError(Exception):
    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def error_response(code: str, message: str, retry_after_s: float | None = None) -> JSONResponse:
    """KServe's error body ({"error": message}) plus the protocol's error code."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": message, "code": code}, STATUS.get(code, 500), headers)


def openai_error(code: str, message: str, retry_after_s: float | None = None,
                 param: str | None = None) -> JSONResponse:  # fmt: skip
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    status = STATUS.get(code, 500)
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status, headers)  # fmt: skip


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future


def _resolve(p: _Pending, value: tuple) -> None:
    if not p.fut.done():
        p.fut.set_result(value)


class HttpFront:
    """The scheduler's callbacks for HTTP jobs: each hands the outcome to the request
    waiting on the event loop."""

    def on_done(self, job: Job) -> None:
        job.ctx.loop.call_soon_threadsafe(_resolve, job.ctx, ("ok", None, None))

    def on_fail(self, job: Job, code: str, message: str) -> None:
        job.ctx.loop.call_soon_threadsafe(_resolve, job.ctx, ("error", code, message))

    def on_partial(self, job: Job, start: int, stop: int) -> None:
        pass  # HTTP tensor jobs are never streamed


# Documentation of the infer request for the OpenAPI document: the body is read by hand
# (it may be JSON followed by binary tensor data), so no model class parses it.
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 256},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
        "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "INT8", "INT16", "INT32",
                                                 "INT64", "FP16", "FP32", "FP64"]},  # fmt: skip
        "data": {"type": "array", "description": "row-major values (flat or nested)"},
        "parameters": {
            "type": "object",
            "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
        },
    },
}
_INFER_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "inputs": {"type": "array", "items": _TENSOR, "minItems": 1},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "parameters": {"type": "object",
                                   "properties": {"binary_data": {"type": "boolean"}}},
                },
            },
        },
        "parameters": {"type": "object",
                       "properties": {"binary_data_output": {"type": "boolean"}}},
    },
}  # fmt: skip
_ERROR = {
    "description": "error",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error", "code"],
        "properties": {"error": {"type": "string"}, "code": {"type": "string"}}}}},
}  # fmt: skip


def make_app(service: Service | LLMService, cfg: HttpConfig) -> FastAPI:
    """The app of one served bundle: health, metrics and the KServe v2 model routes for
    a tensor bundle, the OpenAI routes for a language model."""
    llm = isinstance(service, LLMService)
    what = ("OpenAI-compatible completions" if llm
            else "the Open Inference Protocol (KServe v2)")  # fmt: skip
    # no /docs or /redoc pages: they load their scripts from a CDN a device cannot reach
    app = FastAPI(title="edgepack", version=__version__, docs_url=None, redoc_url=None,
                  description=f"edgepack serve: {what} for one model bundle; see "
                              "docs/http.md.")  # fmt: skip
    model = service.model

    app.add_middleware(_Guard, service=service, keys=[k.encode() for k in cfg.api_keys])

    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, e: HttpError):
        service.metrics.error(e.code)  # every error answer, counted once
        if request.url.path.startswith("/v1/"):
            return openai_error(e.code, e.message, e.retry_after_s)
        return error_response(e.code, e.message, e.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette(request: Request, e: StarletteHTTPException):
        # the framework's own refusals (a body that is not JSON, an unknown path or
        # method) in the protocol's error shape too
        code = {400: "malformed", 404: "not_found", 405: "method_not_allowed"}.get(
            e.status_code, "http_error")
        say = openai_error if request.url.path.startswith("/v1/") else error_response
        resp = say(code, str(e.detail))
        resp.status_code = e.status_code
        resp.headers.update(e.headers or {})
        return resp

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        # pydantic's 422 is a 400 here, in the protocol's shape, naming the field
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        service.metrics.error("invalid_job")
        if request.url.path.startswith("/v1/"):
            return openai_error("invalid_job", message[:500], param=where or None)
        return error_response("invalid_job", message[:500])

    @app.get("/health", summary="Ready when the model is loaded and not draining",
             responses={503: _ERROR})  # fmt: skip
    async def health():
        if service.closed:
            return error_response("shutting_down", "draining")
        return {"status": "ok", "model": model}

    @app.get("/v2/health/live", summary="KServe v2: the server is up")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready", summary="KServe v2: ready for inference",
             responses={503: _ERROR})  # fmt: skip
    async def ready():
        if service.closed:
            return error_response("shutting_down", "draining")
        return {"ready": True}

    @app.get("/v2", summary="KServe v2: server metadata")
    async def server_metadata():
        return {"name": "edgepack", "version": __version__, "extensions": ["binary_tensor_data"]}

    if llm:
        app.state.max_tokens = service.max_tokens or service.engine.ctx
        add_openai_routes(app, service, HttpError)
    else:
        _tensor_routes(app, service)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics():
        text = service.metrics.prometheus(_gauges(service))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    app.openapi = lambda: _openapi(app)
    return app


class _Guard:
    """Every request passes here: the API key, the /v1 bodies' size limit, the request
    and latency metrics. Plain ASGI, not Starlette's ``BaseHTTPMiddleware``: that one
    runs the app in a task group and hands each chunk of a response through a memory
    stream, two task switches a token of every event stream (with 8 streams, 20 % of
    the HTTP thread's samples in py-spy, on the cores the decode steps need)."""

    def __init__(self, app, service: Service | LLMService, keys: list[bytes]) -> None:
        self.app, self.service, self.keys = app, service, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        service, path = self.service, scope["path"]
        request = Request(scope, receive)
        if self.keys and path not in PUBLIC:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            ok = scheme.lower() == "bearer" and any(
                hmac.compare_digest(given.strip().encode(), k) for k in self.keys
            )
            if not ok:
                service.metrics.error("unauthorized")
                say = error_response if not path.startswith("/v1/") else openai_error
                resp = say("unauthorized", "missing or wrong API key (Authorization: Bearer KEY)")
                if path.startswith("/v1/"):
                    resp.headers["WWW-Authenticate"] = "Bearer"
                _count(service, request, resp.status_code)
                return await resp(scope, receive, send)
        if scope["method"] == "POST" and path.startswith("/v1/"):
            # the OpenAI bodies (parsed by FastAPI) under the same --max-job-bytes as
            # v2's: read here, refused past the limit, replayed to the app as read
            try:
                body = await _read_body(request, service.cfg.max_job_bytes)
            except HttpError as e:
                service.metrics.error(e.code)
                resp = openai_error(e.code, e.message)
                _count(service, request, resp.status_code)
                return await resp(scope, receive, send)
            receive = _replay(body, receive)
        status = 500  # what ServerErrorMiddleware answers if the app raises

        async def sent(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if path.endswith(("/infer", "/embeddings")) and status == 200:
                    service.metrics.latency((time.monotonic() - t0) * 1e3, "http")
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            _count(service, request, status)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` (already read) once, then what the
    connection says (a disconnect, which a streaming response listens for)."""
    given = False

    async def again():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


_OPENAI_ERROR = {
    "description": "error (OpenAI's shape)",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "code"],
                                 "properties": {"message": {"type": "string"},
                                                "type": {"type": "string"},
                                                "param": {"type": ["string", "null"]},
                                                "code": {"type": "string"}}}}}}},
}  # fmt: skip


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document with the statuses this server answers: a request body that
    does not validate is 400 in the protocol's error shape (FastAPI documents 422),
    every route but the health checks may answer 401, and every error has its body."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)  # fmt: skip
    for path, ops in doc["paths"].items():
        err = _OPENAI_ERROR if path.startswith("/v1/") else _ERROR
        for op in ops.values():
            r = op.setdefault("responses", {})
            had_422 = r.pop("422", None) is not None
            if had_422 or "requestBody" in op:
                r["400"] = err
            if path not in PUBLIC:
                r["401"] = err
            if path.startswith("/v1/") and "requestBody" in op:
                r.update({"413": err, "429": err, "500": err, "503": err})
            for code in list(r):
                if code != "200" and code.isdigit():
                    r[code] = err
    # the server's own limits, where a schema can say them
    cap = getattr(app.state, "max_tokens", None)
    for name in ("ChatRequest", "CompletionRequest"):
        props = doc.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            for alt in props.get(field, {}).get("anyOf", []):
                if cap and alt.get("type") == "integer":
                    alt["maximum"] = cap
    doc.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    doc.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    app.openapi_schema = doc
    return doc


def _gauges(service: Service | LLMService) -> dict[str, tuple[str, float]]:
    if isinstance(service, LLMService):
        e = service.engine
        return {
            "edgepack_queue_depth": ("Sequences waiting or running.", e.depth),
            "edgepack_queue_limit": ("Most sequences waiting for a slot.", e.max_waiting),
            "edgepack_kv_slots_in_use": ("KV-cache slots holding a sequence.", e.active),
            "edgepack_kv_slots": ("KV-cache slots the engine runs.", e.slots),
            "edgepack_decode_steps_total": ("Batched decode steps.", e.steps),
            "edgepack_decode_rows_total": ("Sequences advanced by decode steps.", e.rows),
        }  # fmt: skip
    s = service.sched
    return {
        "edgepack_queue_depth": ("Accepted, unfinished jobs.", s.depth),
        "edgepack_queue_limit": ("Most accepted, unfinished jobs.", service.cfg.max_queue),
        "edgepack_workers": ("Arenas running jobs.", service.cfg.workers),
        "edgepack_batches_total": ("Model runs.", s.batches),
        "edgepack_rows_total": ("Rows run (batched bundles count each row).", s.rows_run),
    }  # fmt: skip


def _tensor_routes(app: FastAPI, service: Service) -> None:
    """KServe v2 model metadata, readiness and inference of a tensor bundle."""
    front = HttpFront()
    model = service.model
    limit = service.cfg.max_job_bytes

    def check_model(name: str, version: str | None = None) -> None:
        if name != model or version not in (None, "1"):
            what = f"{name!r}" + (f" version {version!r}" if version is not None else "")
            raise HttpError("not_found", f"model {what[:300]} is not served here; this "
                                         f"server serves {model!r} (version 1)")  # fmt: skip

    def metadata() -> dict:
        return {
            "name": model,
            "versions": ["1"],
            "platform": "edgepack",
            "inputs": [_meta(t) for t in service.inputs],
            "outputs": [_meta(t) for t in service.outputs],
        }

    @app.get("/v2/models/{name}", summary="KServe v2: model metadata", responses={404: _ERROR})
    async def model_metadata(name: str):
        check_model(name)
        return metadata()

    @app.get("/v2/models/{name}/versions/{version}", summary="KServe v2: model metadata",
             responses={404: _ERROR})  # fmt: skip
    async def model_version_metadata(name: str, version: str):
        check_model(name, version)
        return metadata()

    @app.get("/v2/models/{name}/ready", summary="KServe v2: model ready",
             responses={404: _ERROR, 503: _ERROR})  # fmt: skip
    async def model_ready(name: str):
        check_model(name)
        if service.closed:
            return error_response("shutting_down", "draining")
        return {"name": model, "ready": True}

    infer_doc = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _INFER_REQUEST},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        },
    }
    codes = {c: _ERROR for c in (400, 404, 413, 429, 500, 503, 504)}

    async def run_job(arrays: list, rows: int, rid: str) -> Job:
        """Queue a tensor job on the shared scheduler and wait for it: HttpError when
        it is refused or fails."""
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future())
        job = Job(rid, arrays, rows, None, False, time.monotonic(), ctx=pending, front=front)
        service.metrics.inc("received")
        refused = service.sched.submit(job)
        if refused == "busy":
            raise HttpError("busy", f"queue full ({service.cfg.max_queue} jobs); retry later",
                            service.sched.retry_after_ms() / 1e3)  # fmt: skip
        if refused:
            raise HttpError(refused, "the server is shutting down; retry elsewhere", 1.0)
        status, code, message = await pending.fut
        if status != "ok":
            raise HttpError(code, message)
        service.metrics.inc("ok")
        return job

    if service.encoder is not None:
        add_embedding_routes(app, service, HttpError, run_job)

    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        check_model(name, version)
        body = await _read_body(request, limit)
        hlen = request.headers.get(HEADER_LENGTH)
        if hlen is not None:
            if not hlen.isdigit() or int(hlen) > len(body):
                raise HttpError("malformed", f"{HEADER_LENGTH} {hlen[:32]!r} does not fit a "
                                             f"body of {len(body)} bytes")  # fmt: skip
            header, binary = body[: int(hlen)], memoryview(body)[int(hlen) :]
        else:
            header, binary = body, memoryview(b"")
        try:
            req = loads_json(header.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise HttpError("malformed", f"the request is not UTF-8 JSON ({e})"[:300]) from None
        if not isinstance(req, dict):
            raise HttpError("malformed", "the request must be a JSON object")
        rid = req.get("id")
        if rid is not None and not isinstance(rid, str):
            raise HttpError("malformed", "'id' must be a string")
        try:
            feeds = tensors_from_kserve(req.get("inputs"), binary, limit)
            arrays, rows = service.sched.prepare(feeds)
        except CodecError as e:
            raise HttpError(e.code, e.message) from None
        except BadInput as e:
            raise HttpError("bad_input", str(e)) from None
        wanted, binary_out = _requested_outputs(req, [t["name"] for t in service.outputs])
        job = await run_job(arrays, rows, rid or uuid.uuid4().hex)
        outputs, raw = tensors_to_kserve({k: job.outputs[k] for k in wanted}, binary_out)
        resp = {"model_name": model, "model_version": "1", "outputs": outputs}
        if rid is not None:
            resp["id"] = rid
        text = json.dumps(resp, separators=(",", ":")).encode()
        if not raw:
            return Response(text, media_type="application/json")
        return Response(text + raw, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(text))})  # fmt: skip

    @app.post("/v2/models/{name}/infer", summary="KServe v2: run the model",
              openapi_extra=infer_doc, responses=codes)  # fmt: skip
    async def infer_latest(name: str, request: Request):
        return await infer(name, request)

    @app.post("/v2/models/{name}/versions/{version}/infer", summary="KServe v2: run the model",
              openapi_extra=infer_doc, responses=codes)  # fmt: skip
    async def infer_version(name: str, version: str, request: Request):
        return await infer(name, request, version)


def _meta(t: dict) -> dict:
    from ..executor import DTYPES

    return {"name": t["name"], "datatype": kserve_datatype(DTYPES[t["dtype"]]),
            "shape": list(t["shape"])}  # fmt: skip


def _count(service: Service, request: Request, status: int) -> None:
    route = request.scope.get("route")
    path = getattr(route, "path", None) or "other"  # the template, not the raw path
    service.metrics.request(request.method, path, status)


def _requested_outputs(req: dict, names: list[str]) -> tuple[list[str], set[str] | bool]:
    """The outputs to answer with, and which of them go as binary data."""
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise HttpError("malformed", "'parameters' must be an object")
    every = params.get("binary_data_output", False)
    if not isinstance(every, bool):
        raise HttpError("malformed", "binary_data_output must be true or false")
    outs = req.get("outputs")
    if outs is None:
        return names, every
    if not isinstance(outs, list) or not outs:
        raise HttpError("malformed", "'outputs' must be a non-empty list")
    wanted, binary = [], set()
    for o in outs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise HttpError("malformed", "each requested output needs a 'name'")
        if o["name"] not in names:
            raise HttpError("bad_input", f"output {o['name'][:64]!r} does not exist; the model "
                                         f"has {', '.join(names)}")  # fmt: skip
        p = o.get("parameters") or {}
        if not isinstance(p, dict):
            raise HttpError("malformed", "an output's 'parameters' must be an object")
        if p.get("binary_data", every):
            binary.add(o["name"])
        if o["name"] not in wanted:
            wanted.append(o["name"])
    return wanted, binary


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with too_large past ``limit`` (what the header declares, or
    what arrives when it declares nothing) before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError("too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise HttpError("too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class HttpServer:
    """uvicorn on a thread of its own, beside the MQTT agent's."""

    def __init__(self, service: Service, cfg: HttpConfig) -> None:
        # What Starlette's streaming responses load on first use (anyio's asyncio
        # backend, ~15 modules), loaded now: the first stream imported them on the loop
        # thread while the engine thread held the GIL, one file read per hand-over.
        import anyio._backends._asyncio  # noqa: F401
        import uvicorn

        self.cfg = cfg
        config = uvicorn.Config(
            make_app(service, cfg), host=cfg.host, port=cfg.port, log_level="warning",
            ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key, lifespan="off",
            timeout_graceful_shutdown=service.cfg.drain_timeout + 5, access_log=False,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="edgepack-http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the HTTP server did not start on {self.cfg.host}:"
                                   f"{self.cfg.port} (address in use?)")  # fmt: skip
            time.sleep(0.02)
        scheme = "https" if self.cfg.tls_cert else "http"
        log.info("serving HTTP on %s://%s:%d", scheme, self.cfg.host, self.cfg.port)

    def stop_accepting(self) -> None:
        """Close the listening socket; requests in flight are answered (uvicorn waits
        for them) while the service drains."""
        self.server.should_exit = True

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
