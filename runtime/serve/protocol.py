"""The edgepack MQTT job protocol, version 1 (specified in docs/protocol.md).

Shared by the agent (``runtime/serve/agent.py``) and the client (``edgepack/client.py``):
topic names, error codes, MQTT v5 user-property names, parsing a job message into a
``JobRequest`` and rendering/parsing replies. No paho import here: properties arrive as
a plain ``Props`` so this module is testable without a broker.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .codec import (
    BINARY_TYPES,
    CT_JSON,
    CT_NPY,
    CodecError,
    decode_binary,
    encode_binary,
    loads_json,
    sniff_content_type,
    tensors_from_json,
    tensors_to_json_fragment,
)

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "edgepack/v1"

# Stable error codes (docs/protocol.md, "Errors"). RETRYABLE: the same job may succeed
# if sent again later or to another agent.
ERROR_CODES = (
    "malformed",
    "invalid_job",
    "unsupported",
    "bad_input",
    "too_large",
    "busy",
    "deadline_exceeded",
    "shutting_down",
    "input_unavailable",
    "internal",
)
RETRYABLE = frozenset({"busy", "deadline_exceeded", "shutting_down", "input_unavailable"})

# MQTT v5 user properties (all values are strings).
UP_VERSION = "ep-v"
UP_ID = "ep-id"
UP_TIMEOUT = "ep-timeout-ms"
UP_DEADLINE = "ep-deadline-ms"
UP_STREAM = "ep-stream"
UP_ACCEPT = "ep-accept"
UP_META = "ep-meta"  # binary replies: the JSON envelope (what a JSON reply has besides outputs)
UP_OUTPUT = "ep-output"  # the output name of an .npy reply (an .npy file has no names)

ACCEPT_FORMATS = ("json", "b64", "npy", "npz", "safetensors")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_ID = 128
MAX_TOPIC = 512
MAX_TIMEOUT_MS = 24 * 3600 * 1000


def device_jobs_topic(prefix: str, device: str) -> str:
    return f"{prefix}/dev/{device}/jobs"


def model_jobs_topic(prefix: str, model: str) -> str:
    return f"{prefix}/model/{model}/jobs"


def shared_subscription(prefix: str, group: str, model: str) -> str:
    return f"$share/{group}/{model_jobs_topic(prefix, model)}"


def status_topic(prefix: str, device: str) -> str:
    return f"{prefix}/dev/{device}/status"


def metrics_topic(prefix: str, device: str) -> str:
    return f"{prefix}/dev/{device}/metrics"


def reply_topic(prefix: str, client_id: str) -> str:
    return f"{prefix}/reply/{client_id}"


def blob_topic(prefix: str, owner: str, blob_id: str) -> str:
    return f"{prefix}/blob/{owner}/{blob_id}"


class ProtocolError(Exception):
    """A job that gets an error reply. ``job_id`` is known when the envelope was read
    far enough to find it."""

    def __init__(self, code: str, message: str, job_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.job_id = job_id
        self.reply: ReplyAddress | None = None  # where to send the error, when known


@dataclass
class Props:
    """The MQTT v5 properties the protocol reads (None/empty for MQTT 3.1.1)."""

    response_topic: str | None = None
    correlation: bytes | None = None
    content_type: str | None = None
    user: dict[str, str] = field(default_factory=dict)


@dataclass
class ReplyAddress:
    topic: str
    correlation: bytes | None = None  # v5 CorrelationData, echoed as a property
    json_correlation: object = None  # 3.1.1 fallback: the job's "correlation", echoed in JSON
    v5: bool = True
    # The agent's connection the job came in on (it answers on the same one); not part
    # of the address's identity.
    via: object = field(default=None, compare=False, repr=False)


@dataclass
class BlobRef:
    """An input sent by reference: retained chunks on ``topic/0 .. topic/parts-1``."""

    topic: str
    parts: int
    nbytes: int
    sha256: str
    content_type: str


@dataclass
class JobRequest:
    id: str
    feeds: dict[str, np.ndarray] | None  # None when ``ref`` is set
    ref: BlobRef | None
    deadline: float | None  # time.monotonic() value
    stream: bool
    accept: str  # one of ACCEPT_FORMATS
    reply: ReplyAddress | None
    received: float  # time.monotonic() at arrival
    generate: dict | None = None  # a generation job's request (language models)
    cancel: bool = False  # a cancel message for the running job ``id``


def valid_topic(t: object) -> bool:
    return (
        isinstance(t, str)
        and 0 < len(t) <= MAX_TOPIC
        and not t.startswith("$")
        and "+" not in t
        and "#" not in t
        and "\x00" not in t
    )


def _valid_id(v: object) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_ID and v.isprintable()


def _int_ms(v: object, what: str, job_id: str | None) -> int:
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            raise ProtocolError("invalid_job", f"{what} must be an integer", job_id) from None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError("invalid_job", f"{what} must be a non-negative integer", job_id)
    return v


def _flag(v: object, what: str, job_id: str | None) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "0", "false", ""):
        return v.lower() in ("1", "true")
    raise ProtocolError("invalid_job", f"{what} must be true or false", job_id)


def peek_job_id(props: Props) -> str | None:
    v = props.user.get(UP_ID)
    return v if _valid_id(v) else None


def reply_address(props: Props, body: Mapping | None = None) -> ReplyAddress | None:
    """Where the answer goes: the v5 ResponseTopic, else the 3.1.1 ``reply_to`` field."""
    if valid_topic(props.response_topic):
        return ReplyAddress(props.response_topic, props.correlation, None, True)
    if body is not None and valid_topic(body.get("reply_to")):
        corr = body.get("correlation")
        if corr is not None and not isinstance(corr, (str, int, float)):
            corr = None
        return ReplyAddress(body["reply_to"], props.correlation, corr, False)
    return None


def parse_job(
    payload: bytes,
    props: Props,
    *,
    limit: int,
    input_dtypes: Mapping[str, np.dtype],
    prefix: str,
    now: float | None = None,
) -> JobRequest:
    """Decode one job message. Raises ProtocolError (with whatever job id was found)
    for anything that is not a valid job; the caller finds the reply address with
    ``reply_address`` first, so even a malformed job can be answered."""
    found: list[ReplyAddress | None] = [reply_address(props)]
    try:
        return _parse_job(payload, props, limit, input_dtypes, prefix, now, found)
    except ProtocolError as e:
        e.reply = found[0]
        raise


def _parse_job(payload, props, limit, input_dtypes, prefix, now, found) -> JobRequest:
    now = time.monotonic() if now is None else now
    pid = peek_job_id(props)
    if len(payload) > limit:
        raise ProtocolError(
            "too_large", f"payload of {len(payload)} bytes exceeds the limit of {limit}", pid
        )
    ctype = (props.content_type or "").split(";")[0].strip().lower()
    if not ctype:
        ctype = sniff_content_type(payload)
    meta: dict = dict(props.user)
    if ctype == CT_JSON:
        body = decode_json_body(payload, pid)
        found[0] = reply_address(props, body)
        meta.update({k: v for k, v in body.items() if k != "inputs"})
        feeds_src: object = body.get("inputs")
    elif ctype in BINARY_TYPES:
        body, feeds_src = None, None
    else:
        raise ProtocolError(
            "unsupported" if props.content_type else "malformed",
            f"content type {ctype[:64]!r} is not supported"
            if props.content_type
            else "payload is neither JSON, .npy, .npz nor safetensors",
            pid,
        )
    raw_id = meta.get("id", meta.get(UP_ID))
    job_id = raw_id if _valid_id(raw_id) else None
    if job_id is None:
        raise ProtocolError(
            "invalid_job",
            f"job id missing or invalid: give 'id' (JSON) or the {UP_ID!r} user property, "
            f"1 to {MAX_ID} printable characters",
            None,
        )
    v = meta.get("v", meta.get(UP_VERSION, PROTOCOL_VERSION))
    if str(v) != str(PROTOCOL_VERSION):
        raise ProtocolError(
            "unsupported", f"protocol version {str(v)[:16]!r}; this agent speaks 1", job_id
        )
    deadline = None
    if meta.get("timeout_ms", meta.get(UP_TIMEOUT)) is not None:
        t = _int_ms(meta.get("timeout_ms", meta.get(UP_TIMEOUT)), "timeout_ms", job_id)
        deadline = now + min(t, MAX_TIMEOUT_MS) / 1e3
    if meta.get("deadline_ms", meta.get(UP_DEADLINE)) is not None:
        d = _int_ms(meta.get("deadline_ms", meta.get(UP_DEADLINE)), "deadline_ms", job_id)
        # Absolute wall-clock deadline (needs synchronised clocks) -> monotonic.
        dl = now + (d / 1e3 - time.time())
        deadline = dl if deadline is None else min(deadline, dl)
    stream = _flag(meta.get("stream", meta.get(UP_STREAM, False)), "stream", job_id)
    accept = meta.get("accept", meta.get(UP_ACCEPT))
    if accept is None:
        accept = "json" if ctype == CT_JSON else BINARY_TYPES[ctype]
        if accept == "json" and _uses_b64(feeds_src):
            accept = "b64"
    if accept not in ACCEPT_FORMATS:
        raise ProtocolError(
            "unsupported", f"accept must be one of {', '.join(ACCEPT_FORMATS)}", job_id
        )
    reply = found[0]
    ref = None
    feeds = None
    if body is not None and ("generate" in body or "cancel" in body):
        if feeds_src is not None or "ref" in body:
            raise ProtocolError("invalid_job", "a generation job has no 'inputs' or 'ref'", job_id)
        if "cancel" in body:
            if body["cancel"] is not True:
                raise ProtocolError("invalid_job", "'cancel' must be true", job_id)
            return JobRequest(job_id, None, None, deadline, stream, "json", reply, now,
                              cancel=True)  # fmt: skip
        if not isinstance(body["generate"], dict):
            raise ProtocolError("invalid_job", "'generate' must be an object", job_id)
        return JobRequest(job_id, None, None, deadline, stream, "json", reply, now,
                          generate=body["generate"])  # fmt: skip
    if body is not None and "ref" in body:
        if feeds_src is not None:
            raise ProtocolError("invalid_job", "give either 'inputs' or 'ref', not both", job_id)
        ref = _parse_ref(body["ref"], prefix, limit, job_id)
        if meta.get("accept", meta.get(UP_ACCEPT)) is None:  # answer in the inputs' format
            accept = BINARY_TYPES.get(ref.content_type, accept)
    else:
        single = next(iter(input_dtypes)) if len(input_dtypes) == 1 else None
        try:
            if body is not None:
                if feeds_src is None:
                    raise ProtocolError("invalid_job", "missing 'inputs' (or 'ref')", job_id)
                if isinstance(feeds_src, list) and single is not None:
                    feeds_src = {single: feeds_src}  # a bare array: the model's one input
                feeds = tensors_from_json(feeds_src, limit, input_dtypes)
            else:
                feeds = decode_binary(payload, ctype, limit, single)
        except CodecError as e:
            raise ProtocolError(e.code, e.message, job_id) from None
    return JobRequest(job_id, feeds, ref, deadline, stream, accept, reply, now)


def decode_json_body(payload: bytes, job_id: str | None) -> dict:
    try:
        body = loads_json(bytes(payload).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: "[[[[..." nested deeper than the parser's stack
        raise ProtocolError(
            "malformed", f"payload is not UTF-8 JSON ({type(e).__name__}: {e})"[:300], job_id
        ) from None
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "JSON payload must be an object", job_id)
    return body


def decode_feeds(payload: bytes, content_type: str, limit: int, input_dtypes) -> dict:
    """Tensors of a reassembled by-reference payload (JSON 'inputs' object or binary)."""
    ctype = content_type or sniff_content_type(payload)
    if ctype == CT_JSON:
        body = decode_json_body(payload, None)
        return tensors_from_json(body.get("inputs", body), limit, input_dtypes)
    single = next(iter(input_dtypes)) if len(input_dtypes) == 1 else None
    return decode_binary(payload, ctype, limit, single)


def _uses_b64(src: object) -> bool:
    return isinstance(src, dict) and any(isinstance(t, dict) and "b64" in t for t in src.values())


def _parse_ref(r: object, prefix: str, limit: int, job_id: str) -> BlobRef:
    if not isinstance(r, dict):
        raise ProtocolError("invalid_job", "'ref' must be an object", job_id)
    topic, parts, nbytes = r.get("topic"), r.get("parts"), r.get("bytes")
    sha, ctype = r.get("sha256"), r.get("content_type", CT_JSON)
    if not valid_topic(topic) or not topic.startswith(f"{prefix}/blob/"):
        raise ProtocolError(
            "invalid_job", f"'ref.topic' must be a topic under {prefix}/blob/", job_id
        )
    for v, what in ((parts, "parts"), (nbytes, "bytes")):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProtocolError("invalid_job", f"'ref.{what}' must be a positive integer", job_id)
    if parts > 100_000 or parts > nbytes:
        raise ProtocolError("invalid_job", "'ref.parts' out of range", job_id)
    if nbytes > limit:
        raise ProtocolError(
            "too_large", f"referenced input of {nbytes} bytes exceeds the limit of {limit}", job_id
        )
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ProtocolError("invalid_job", "'ref.sha256' must be 64 lowercase hex digits", job_id)
    if ctype != CT_JSON and ctype not in BINARY_TYPES:
        raise ProtocolError("unsupported", "'ref.content_type' is not supported", job_id)
    return BlobRef(topic, parts, nbytes, sha, ctype)


# --- replies ----------------------------------------------------------------------------


@dataclass
class Reply:
    """One reply message before it is addressed: ``meta`` is the JSON envelope without
    outputs; ``body`` holds the encoded outputs (a JSON fragment for json/b64, bytes for
    a binary format) or None (errors, stream finals)."""

    meta: dict
    body: str | bytes | None = None
    content_type: str = CT_JSON
    npy_name: str | None = None  # the output's name when body is an .npy (which has none)

    @property
    def nbytes(self) -> int:
        return len(self.body or b"") + 256


def ok_reply(meta: dict, outputs: Mapping[str, np.ndarray] | None, accept: str) -> Reply:
    if outputs is None:
        return Reply(meta)
    if accept in ("json", "b64"):
        return Reply(meta, tensors_to_json_fragment(outputs, b64=accept == "b64"))
    data, ctype = encode_binary(outputs, accept)
    return Reply(meta, data, ctype, next(iter(outputs)) if ctype == CT_NPY else None)


def error_meta(code: str, message: str, **extra) -> dict:
    err = {"code": code, "message": message, "retryable": code in RETRYABLE}
    return {"status": "error", "error": err, "final": True, **extra}


def render(reply: Reply, addr: ReplyAddress, dup: bool = False) -> tuple[bytes, str, list]:
    """(payload, content type, v5 user properties) of ``reply`` sent to ``addr``."""
    meta = dict(reply.meta)
    if dup:
        meta["dup"] = True
    if addr.json_correlation is not None:
        meta["correlation"] = addr.json_correlation
    binary = isinstance(reply.body, bytes)
    if binary and not addr.v5:
        # A 3.1.1 client cannot read a content type: it always gets JSON + base64.
        # (Rare: a binary answer stored for a v5 request, re-sent to a 3.1.1 retry.)
        binary = False
        arrays = decode_binary(reply.body, reply.content_type, 1 << 62, reply.npy_name)
        reply = Reply(reply.meta, tensors_to_json_fragment(arrays, b64=True))
    # Few properties on purpose: paho parses each received one with a linear name scan
    # (~40 us apiece). JSON replies need none; binary ones carry the envelope as ep-meta.
    text = json.dumps(meta, separators=(",", ":"))
    if binary:
        user = [(UP_META, text)]
        if reply.npy_name:
            user.append((UP_OUTPUT, reply.npy_name))
        return reply.body, reply.content_type, user
    if reply.body is not None:
        text = text[:-1] + ',"outputs":' + reply.body + "}"
    return text.encode(), CT_JSON, []


@dataclass
class ReplyMessage:
    """A reply as the client sees it."""

    id: str | None
    status: str  # ok | partial | error
    final: bool
    meta: dict
    outputs: dict[str, np.ndarray] | None


def parse_reply(payload: bytes, props: Props, limit: int = 1 << 31) -> ReplyMessage:
    ctype = (props.content_type or "").split(";")[0].strip().lower() or sniff_content_type(payload)
    if ctype in BINARY_TYPES:
        u = props.user
        meta = _json_or_none(u.get(UP_META)) or {"id": u.get(UP_ID), "status": "ok"}
        outputs = decode_binary(payload, ctype, limit, u.get(UP_OUTPUT, "output"))
        status, final = meta.get("status", "ok"), bool(meta.get("final", True))
        return ReplyMessage(meta.get("id"), status, final, meta, outputs)
    try:
        meta = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CodecError("malformed", "reply is not JSON") from e
    if not isinstance(meta, dict) or "status" not in meta:
        raise CodecError("malformed", "reply has no status")
    outs = meta.pop("outputs", None)
    outputs = tensors_from_json(outs, limit) if outs else None
    return ReplyMessage(
        meta.get("id"), meta["status"], bool(meta.get("final", True)), meta, outputs
    )


def _json_or_none(text: str | None) -> dict | None:
    try:
        v = json.loads(text) if text else None
    except ValueError:
        return None
    return v if isinstance(v, dict) else None
