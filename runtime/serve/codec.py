"""Tensor encodings of the MQTT protocol (docs/protocol.md, "Payloads").

JSON tensors (numbers or base64), .npy, .npz and safetensors bytes, in both directions.
Every decoder treats its input as hostile: declared sizes are checked against the bytes
actually present and against a byte limit *before* anything is allocated, no pickle is
ever loaded, and every failure is a ``CodecError`` with a stable protocol code, never a
crash. Needs only numpy (the agent must stay importable in the frozen device runtime).
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import zipfile
from collections.abc import Mapping

import numpy as np

# Short dtype names used on the wire (and in the bundle manifest), with the safetensors
# spellings. Little-endian always.
DTYPES: dict[str, np.dtype] = {
    "f64": np.dtype("<f8"),
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "i64": np.dtype("<i8"),
    "i32": np.dtype("<i4"),
    "i16": np.dtype("<i2"),
    "i8": np.dtype("i1"),
    "u8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_ALIASES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
}
SAFETENSORS_DTYPES = {
    "F64": "f64",
    "F32": "f32",
    "F16": "f16",
    "I64": "i64",
    "I32": "i32",
    "I16": "i16",
    "I8": "i8",
    "U8": "u8",
    "BOOL": "bool",
}
_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

CT_JSON = "application/json"
CT_NPY = "application/x-npy"
CT_NPZ = "application/x-npz"
CT_SAFETENSORS = "application/x-safetensors"
BINARY_TYPES = {CT_NPY: "npy", CT_NPZ: "npz", CT_SAFETENSORS: "safetensors"}
FORMAT_TYPES = {v: k for k, v in BINARY_TYPES.items()}

MAX_RANK = 8
MAX_TENSORS = 64
MAX_NAME = 256


class CodecError(ValueError):
    """A payload that cannot be decoded; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def short_dtype(dt: np.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise CodecError("unsupported", f"dtype {dt} has no wire name")


def wire_dtype(name: object) -> np.dtype:
    if not isinstance(name, str):
        raise CodecError("malformed", "tensor dtype must be a string")
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise CodecError(
            "unsupported", f"dtype {name[:32]!r} is not supported; use one of {', '.join(DTYPES)}"
        )
    return DTYPES[key]


def _check_shape(shape: object, what: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK:
        raise CodecError("malformed", f"{what}: shape must be a list of at most {MAX_RANK} ints")
    for d in shape:
        # bool is an int subclass: [true, 3] is not a shape
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise CodecError("malformed", f"{what}: shape must hold non-negative ints")
    return tuple(shape)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize  # Python ints: no overflow on hostile shapes


def _check_budget(nbytes: int, limit: int, what: str) -> None:
    if nbytes > limit:
        raise CodecError("too_large", f"{what}: {nbytes} bytes exceeds the limit of {limit}")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise CodecError("malformed", "tensor names must be non-empty strings")
    return name


# --- JSON tensors ---------------------------------------------------------------------


def tensors_from_json(
    obj: object, limit: int, default_dtypes: Mapping[str, np.dtype] | None = None
) -> dict[str, np.ndarray]:
    """``{"name": <tensor>}`` where a tensor is ``{"dtype","shape","data"|"b64"}`` or a
    bare nested list (converted to the model input's dtype, since JSON has none)."""
    if not isinstance(obj, dict) or not obj:
        raise CodecError("invalid_job", "'inputs' must be a non-empty object keyed by input name")
    if len(obj) > MAX_TENSORS:
        raise CodecError("malformed", f"more than {MAX_TENSORS} tensors")
    out: dict[str, np.ndarray] = {}
    used = 0
    for name, t in obj.items():
        _check_name(name)
        what = f"input {name[:64]!r}"
        if isinstance(t, list):
            # A list costs at least 2 payload bytes per value, so the payload limit
            # already bounds what this allocates.
            dtype = (default_dtypes or {}).get(name, DTYPES["f32"])
            a = _array_from_list(t, dtype, what)
        elif isinstance(t, dict):
            a = _tensor_from_dict(t, limit - used, what)
        else:
            raise CodecError("malformed", f"{what}: expected a nested list or a tensor object")
        used += a.nbytes
        _check_budget(used, limit, "decoded inputs")
        out[name] = a
    return out


def loads_json(text: str | bytes) -> object:
    """``json.loads`` that refuses what JSON cannot spell: Python's parser takes the
    tokens ``NaN``, ``Infinity`` and ``-Infinity``, and turns a number too large for a
    double (``1e400``) into infinity; both are ValueErrors here."""

    def constant(name: str) -> float:
        raise ValueError(f"{name} is not JSON")

    def number(text: str) -> float:
        v = float(text)
        if math.isinf(v):
            raise ValueError(f"number {text[:32]} is out of range")
        return v

    return json.loads(text, parse_constant=constant, parse_float=number)


def _array_from_list(data: list, dtype: np.dtype, what: str) -> np.ndarray:
    """``data`` (nested lists of JSON numbers) as ``dtype``; a value the dtype cannot
    hold (300 as i8, 1.5 as an integer, 1e39 as f32, a number as bool) is refused
    naming it, rather than wrapped, truncated or turned into infinity."""
    try:
        a = np.asarray(data)
    except (ValueError, TypeError) as e:  # ragged
        raise CodecError("malformed", f"{what}: data is not a rectangular array of numbers") from e
    if a.ndim > MAX_RANK:
        raise CodecError("malformed", f"{what}: more than {MAX_RANK} dimensions")
    if a.size == 0:
        return a.astype(dtype)
    if a.dtype.kind not in "biuf":  # strings, nulls, ints past 64 bits
        raise CodecError("malformed", f"{what}: data is not a rectangular array of numbers "
                                      "(or holds an integer past 64 bits)")  # fmt: skip
    if dtype.kind == "b":
        if a.dtype.kind != "b" and not np.isin(a, (0, 1)).all():
            raise CodecError("bad_input", f"{what}: bool tensors take true/false (or 0/1)")
    elif dtype.kind in "iu":
        if a.dtype.kind == "f" and not (a == np.round(a)).all():
            raise CodecError("bad_input", f"{what}: {dtype} tensors take integers")
        info = np.iinfo(dtype)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise CodecError("bad_input", f"{what}: {bad} is out of range for {dtype} "
                                          f"({info.min}..{info.max})")  # fmt: skip
    elif a.dtype.kind == "f" and dtype.itemsize < 8:
        big = np.finfo(dtype).max
        if (np.abs(a) > big).any():
            bad = a.flat[int(np.argmax(np.abs(a)))]
            raise CodecError("bad_input", f"{what}: {bad:g} is out of range for {dtype}")
    return a.astype(dtype)


def _tensor_from_dict(t: dict, budget: int, what: str) -> np.ndarray:
    unknown = set(t) - {"dtype", "shape", "data", "b64"}
    if unknown:
        raise CodecError("malformed", f"{what}: unknown keys {sorted(unknown)[:4]}")
    if "dtype" not in t or "shape" not in t:
        raise CodecError("malformed", f"{what}: a tensor object needs 'dtype' and 'shape'")
    dtype = wire_dtype(t["dtype"])
    shape = _check_shape(t["shape"], what)
    n = _nbytes(shape, dtype)
    _check_budget(n, budget, what)
    if ("data" in t) == ("b64" in t):
        raise CodecError("malformed", f"{what}: give exactly one of 'data' and 'b64'")
    if "b64" in t:
        if not isinstance(t["b64"], str):
            raise CodecError("malformed", f"{what}: 'b64' must be a string")
        try:
            raw = base64.b64decode(t["b64"], validate=True)
        except ValueError as e:
            raise CodecError("malformed", f"{what}: 'b64' is not valid base64") from e
        if len(raw) != n:
            raise CodecError(
                "malformed", f"{what}: 'b64' holds {len(raw)} bytes, shape and dtype need {n}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    data = t["data"]
    if not isinstance(data, list):
        raise CodecError("malformed", f"{what}: 'data' must be a list")
    a = _array_from_list(data, dtype, what)
    if a.size != math.prod(shape):
        raise CodecError(
            "malformed",
            f"{what}: 'data' has {a.size} values, shape {list(shape)} needs {math.prod(shape)}",
        )
    return a.reshape(shape)


def tensor_to_json(a: np.ndarray, b64: bool = False) -> dict:
    a = np.ascontiguousarray(a)
    dtype = short_dtype(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    # Non-finite floats have no JSON spelling: such a tensor goes as base64 instead.
    if not b64 and a.dtype.kind == "f" and not np.isfinite(a).all():
        b64 = True
    t: dict = {"dtype": dtype, "shape": list(a.shape)}
    if b64:
        t["b64"] = base64.b64encode(a.astype(DTYPES[dtype], copy=False).tobytes()).decode()
    else:
        t["data"] = a.ravel().tolist()  # float32 -> shortest double repr: exact round trip
    return t


def tensors_to_json_fragment(arrays: Mapping[str, np.ndarray], b64: bool = False) -> str:
    return json.dumps({k: tensor_to_json(v, b64) for k, v in arrays.items()}, separators=(",", ":"))


# --- .npy -------------------------------------------------------------------------------

_NPY_MAGIC = b"\x93NUMPY"


def decode_npy(buf: bytes | memoryview, limit: int, what: str = "npy") -> np.ndarray:
    mv = memoryview(buf)
    if len(mv) < 10 or bytes(mv[:6]) != _NPY_MAGIC:
        raise CodecError("malformed", f"{what}: not an .npy payload (bad magic)")
    major = mv[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", mv[8:10]), 10
    elif major in (2, 3) and len(mv) >= 12:
        (hlen,), start = struct.unpack("<I", mv[8:12]), 12
    else:
        raise CodecError("malformed", f"{what}: unsupported .npy version {major}")
    if hlen > 65536 or start + hlen > len(mv):
        raise CodecError("malformed", f"{what}: truncated .npy header")
    try:
        import ast

        header = ast.literal_eval(bytes(mv[start : start + hlen]).decode("latin1"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as e:
        raise CodecError("malformed", f"{what}: unreadable .npy header") from e
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise CodecError("malformed", f"{what}: .npy header must hold descr, fortran_order, shape")
    descr = header["descr"]
    if not isinstance(descr, str) or len(descr) > 8:
        raise CodecError("unsupported", f"{what}: .npy dtype {str(descr)[:16]!r} not supported")
    try:
        src = np.dtype(descr)
    except (TypeError, ValueError) as e:
        raise CodecError("malformed", f"{what}: bad .npy dtype") from e
    dt = src.newbyteorder("<") if src.byteorder == ">" else src
    if src.hasobject or not any(dt == v for v in DTYPES.values()):
        raise CodecError("unsupported", f"{what}: .npy dtype {descr[:16]!r} is not supported")
    shape = _check_shape(header["shape"], what)
    n = _nbytes(shape, dt)
    _check_budget(n, limit, what)
    body = mv[start + hlen :]
    if len(body) != n:
        raise CodecError("malformed", f"{what}: {len(body)} data bytes, header declares {n}")
    a = np.frombuffer(body, dtype=src)
    a = a.reshape(shape, order="F" if header["fortran_order"] is True else "C")
    return np.ascontiguousarray(a, dtype=dt)


def encode_npy(a: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, np.ascontiguousarray(a), allow_pickle=False)
    return f.getvalue()


# --- .npz -------------------------------------------------------------------------------


def decode_npz(buf: bytes, limit: int) -> dict[str, np.ndarray]:
    try:
        zf = zipfile.ZipFile(io.BytesIO(buf))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as e:
        raise CodecError("malformed", "not an .npz payload (bad zip)") from e
    if not infos or len(infos) > MAX_TENSORS:
        raise CodecError("malformed", f".npz must hold 1 to {MAX_TENSORS} arrays")
    out: dict[str, np.ndarray] = {}
    budget = limit
    for info in infos:
        name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        _check_name(name)
        # Read at most budget+header bytes whatever the zip declares: a zip bomb stops here.
        cap = budget + 65536 + 16
        try:
            with zf.open(info) as f:
                raw = f.read(cap + 1)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError) as e:
            raise CodecError("malformed", f".npz member {name[:64]!r} is unreadable") from e
        if len(raw) > cap:
            raise CodecError("too_large", f".npz member {name[:64]!r} exceeds the size limit")
        a = decode_npy(raw, budget, f".npz member {name[:64]!r}")
        budget -= a.nbytes
        out[name] = a
    return out


def encode_npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    f = io.BytesIO()
    np.savez(f, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    return f.getvalue()


# --- safetensors ------------------------------------------------------------------------


def decode_safetensors(buf: bytes | memoryview, limit: int) -> dict[str, np.ndarray]:
    mv = memoryview(buf)
    if len(mv) < 8:
        raise CodecError("malformed", "safetensors payload shorter than its 8-byte header length")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if hlen > min(len(mv) - 8, 1 << 20):
        raise CodecError("malformed", "safetensors header length out of range")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CodecError("malformed", "safetensors header is not JSON") from e
    if not isinstance(header, dict):
        raise CodecError("malformed", "safetensors header must be an object")
    data = mv[8 + hlen :]
    header.pop("__metadata__", None)
    if not header or len(header) > MAX_TENSORS:
        raise CodecError("malformed", f"safetensors must hold 1 to {MAX_TENSORS} tensors")
    out: dict[str, np.ndarray] = {}
    total = 0
    for name, e in header.items():
        _check_name(name)
        what = f"tensor {name[:64]!r}"
        if not isinstance(e, dict) or e.get("dtype") not in SAFETENSORS_DTYPES:
            raise CodecError("malformed", f"{what}: bad safetensors entry or dtype")
        dt = DTYPES[SAFETENSORS_DTYPES[e["dtype"]]]
        shape = _check_shape(e.get("shape"), what)
        offs = e.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= len(data)
        ):
            raise CodecError("malformed", f"{what}: data_offsets out of range")
        n = _nbytes(shape, dt)
        total += n
        _check_budget(total, limit, "decoded inputs")
        if offs[1] - offs[0] != n:
            raise CodecError("malformed", f"{what}: {offs[1] - offs[0]} bytes, shape needs {n}")
        out[name] = np.frombuffer(data[offs[0] : offs[1]], dtype=dt).reshape(shape)
    return out


def encode_safetensors(arrays: Mapping[str, np.ndarray]) -> bytes:
    header: dict = {}
    chunks = []
    pos = 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        dt = short_dtype(a.dtype)
        header[name] = {
            "dtype": _TO_SAFETENSORS[dt],
            "shape": list(a.shape),
            "data_offsets": [pos, pos + a.nbytes],
        }
        chunks.append(a.astype(DTYPES[dt], copy=False).tobytes())
        pos += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header with spaces to 8 bytes
    return struct.pack("<Q", len(h)) + h + b"".join(chunks)


# --- dispatch by content type -------------------------------------------------------------


def sniff_content_type(payload: bytes) -> str:
    """The content type of a payload that arrived without one (e.g. an MQTT 3.1.1 client
    or ``mosquitto_pub`` without ``-D publish content-type``)."""
    head = bytes(payload[:8])
    if head.startswith(_NPY_MAGIC):
        return CT_NPY
    if head.startswith(b"PK\x03\x04"):
        return CT_NPZ
    if head.lstrip()[:1] in (b"{", b"["):
        return CT_JSON
    if len(head) == 8 and struct.unpack("<Q", head)[0] < min(len(payload), 1 << 20):
        return CT_SAFETENSORS
    return "application/octet-stream"


def decode_binary(
    payload: bytes, content_type: str, limit: int, single_input: str | None
) -> dict[str, np.ndarray]:
    """Tensors of a binary job payload. ``.npy`` carries the one input of a single-input
    model, whose name is ``single_input``."""
    if content_type == CT_NPY:
        if single_input is None:
            raise CodecError("bad_input", "this model has several inputs: send .npz or safetensors")
        return {single_input: decode_npy(payload, limit)}
    if content_type == CT_NPZ:
        return decode_npz(payload, limit)
    if content_type == CT_SAFETENSORS:
        return decode_safetensors(payload, limit)
    raise CodecError("unsupported", f"content type {content_type[:64]!r} is not supported")


def encode_binary(arrays: Mapping[str, np.ndarray], fmt: str) -> tuple[bytes, str]:
    """Encode outputs as ``fmt`` (npy only for exactly one array; npz otherwise)."""
    if fmt == "npy" and len(arrays) == 1:
        return encode_npy(next(iter(arrays.values()))), CT_NPY
    if fmt == "safetensors":
        return encode_safetensors(arrays), CT_SAFETENSORS
    return encode_npz(arrays), CT_NPZ


# --- the Open Inference Protocol (KServe v2 REST, docs/http.md) ------------------------------

KSERVE_DTYPES = {
    "BOOL": "bool",
    "UINT8": "u8",
    "INT8": "i8",
    "INT16": "i16",
    "INT32": "i32",
    "INT64": "i64",
    "FP16": "f16",
    "FP32": "f32",
    "FP64": "f64",
}
_TO_KSERVE = {v: k for k, v in KSERVE_DTYPES.items()}


def kserve_datatype(dt: np.dtype) -> str:
    return _TO_KSERVE[short_dtype(dt)]


def tensors_from_kserve(inputs: object, binary: bytes | memoryview, limit: int
                        ) -> dict[str, np.ndarray]:  # fmt: skip
    """The ``inputs`` list of a v2 infer request. A tensor with
    ``parameters.binary_data_size`` takes that many bytes of ``binary`` (what follows
    the JSON header: the binary-data extension), in the order the tensors are listed;
    the others carry ``data``, flat in row-major order or nested. The JSON tensors go
    through the same checks as the MQTT protocol's."""
    if not isinstance(inputs, list) or not inputs:
        raise CodecError("invalid_job", "'inputs' must be a non-empty list of tensors")
    if len(inputs) > MAX_TENSORS:
        raise CodecError("malformed", f"more than {MAX_TENSORS} tensors")
    mv = memoryview(binary)
    out: dict[str, np.ndarray] = {}
    used = pos = 0
    for t in inputs:
        if not isinstance(t, dict):
            raise CodecError("malformed", "each input must be an object")
        name = _check_name(t.get("name"))
        what = f"input {name[:64]!r}"
        if name in out:
            raise CodecError("malformed", f"{what} is given twice")
        unknown = set(t) - {"name", "shape", "datatype", "data", "parameters"}
        if unknown:
            raise CodecError("malformed", f"{what}: unknown keys {sorted(unknown)[:4]}")
        dt = t.get("datatype")
        if dt not in KSERVE_DTYPES:
            known = ", ".join(KSERVE_DTYPES)
            raise CodecError("unsupported", f"{what}: datatype {str(dt)[:16]!r} is not "
                                            f"supported; use one of {known}")  # fmt: skip
        dtype = DTYPES[KSERVE_DTYPES[dt]]
        shape = _check_shape(t.get("shape"), what)
        n = _nbytes(shape, dtype)
        _check_budget(used + n, limit, "decoded inputs")
        params = t.get("parameters", {})
        if not isinstance(params, dict):
            raise CodecError("malformed", f"{what}: 'parameters' must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in t:
                raise CodecError("malformed", f"{what}: give 'data' or binary_data_size, not both")
            if not isinstance(size, int) or isinstance(size, bool) or size != n:
                raise CodecError("malformed", f"{what}: binary_data_size {str(size)[:16]}, "
                                              f"shape and datatype need {n}")  # fmt: skip
            if pos + size > len(mv):
                raise CodecError("malformed", f"{what}: the binary data ends {pos + size - len(mv)}"
                                              " bytes short")  # fmt: skip
            a = np.frombuffer(mv[pos : pos + size], dtype=dtype).reshape(shape)
            pos += size
        else:
            data = t.get("data")
            if not isinstance(data, list):
                raise CodecError("malformed", f"{what}: 'data' must be a list")
            a = _array_from_list(data, dtype, what)
            if a.size != math.prod(shape):
                need = math.prod(shape)
                raise CodecError("malformed", f"{what}: 'data' has {a.size} values, shape "
                                              f"{list(shape)} needs {need}")  # fmt: skip
            a = a.reshape(shape)
        used += n
        out[name] = a
    if pos != len(mv):
        raise CodecError("malformed", f"{len(mv) - pos} bytes of binary data no input claims")
    return out


def tensors_to_kserve(arrays: Mapping[str, np.ndarray], binary: bool | set[str]
                      ) -> tuple[list[dict], bytes]:  # fmt: skip
    """The ``outputs`` list of a v2 infer response and the binary data that follows its
    JSON: the tensors named in ``binary`` (all with True) as raw bytes, the others as
    flat ``data``. A float tensor holding NaN or infinity goes binary whatever was asked,
    since JSON cannot spell those values (as the MQTT protocol's JSON goes base64)."""
    outputs, chunks = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        t: dict = {"name": name, "datatype": kserve_datatype(a.dtype), "shape": list(a.shape)}
        raw = binary is True or (binary is not False and name in binary)
        if raw or (a.dtype.kind == "f" and not np.isfinite(a).all()):
            chunks.append(a.tobytes())
            t["parameters"] = {"binary_data_size": a.nbytes}
        else:
            t["data"] = a.ravel().tolist()
        outputs.append(t)
    return outputs, b"".join(chunks)
