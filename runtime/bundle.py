"""Open an ``.epk`` bundle: validate everything, then map the weights zero-copy.

The parser is bounded: every size and offset is checked against the file before it
is used, the manifest and the weight section are checksummed, and only then are
tensors created, as read-only views into one ``mmap`` of the file. A truncated or
bit-flipped bundle raises ``BundleError`` with a message that says what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .bundle_format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    PAD_PREFIX,
    ST_DTYPES,
    TENSOR_DTYPES,
    Header,
)

MAX_MANIFEST = 64 << 20  # a manifest bigger than this is not a manifest we wrote
MAX_ST_HEADER = 64 << 20


class BundleError(Exception):
    """The file is not a valid edgepack bundle (or is corrupt)."""


@dataclass
class Bundle:
    path: str
    offset: int
    header: Header
    manifest: dict
    weights: dict[str, np.ndarray]
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    @property
    def graph(self) -> dict:
        return self.manifest["graph"]

    @property
    def plan(self) -> dict:
        return self.manifest["plan"]

    def close(self) -> None:
        # Views into the map keep it alive; dropping our references is all we can do.
        self.weights = {}
        self._mmap = None


def _fail(path: str, msg: str) -> BundleError:
    return BundleError(f"{path}: not a valid edgepack bundle: {msg}")


_bundle_fail = _fail


def parse_header(raw: bytes, path: str = "<bundle>") -> Header:
    if len(raw) < HEADER_SIZE:
        raise _fail(path, f"file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    if raw[:8] != MAGIC:
        raise _fail(path, "bad magic (this is not an .epk file)")
    (crc,) = struct.unpack_from("<I", raw, HEADER_SIZE - 4)
    if zlib.crc32(raw[: HEADER_SIZE - 4]) != crc:
        raise _fail(path, "header checksum mismatch (corrupt header)")
    f = HEADER_STRUCT.unpack_from(raw)
    _, version, hsize, bsize, moff, msize, woff, wsize, msha, wsha, flags = f
    if version != FORMAT_VERSION:
        raise _fail(path, f"format version {version}; this runtime reads {FORMAT_VERSION}")
    if hsize != HEADER_SIZE:
        raise _fail(path, f"header size {hsize}, expected {HEADER_SIZE}")
    return Header(version, bsize, moff, msize, woff, wsize, msha, wsha, flags)


def _check_ranges(h: Header, available: int, path: str) -> None:
    if h.bundle_size > available:
        raise _fail(path, f"truncated: header says {h.bundle_size} bytes, only {available} present")
    if not (
        HEADER_SIZE <= h.manifest_offset and h.manifest_offset + h.manifest_size <= h.bundle_size
    ):
        raise _fail(path, "manifest lies outside the bundle")
    if h.manifest_size > MAX_MANIFEST:
        raise _fail(path, f"manifest of {h.manifest_size} bytes exceeds {MAX_MANIFEST}")
    if h.weights_offset % ALIGN:
        raise _fail(path, f"weight section offset {h.weights_offset} is not {ALIGN}-byte aligned")
    if not (
        h.manifest_offset + h.manifest_size <= h.weights_offset
        and h.weights_offset + h.weights_size <= h.bundle_size
    ):
        raise _fail(path, "weight section lies outside the bundle or overlaps the manifest")


def parse_safetensors_header(
    buf: memoryview,
    base: int,
    path: str,
    section_size: int,
    fail: Callable[[str, str], Exception] | None = None,
    align: int = ALIGN,
) -> tuple[int, dict]:
    """Validate the safetensors-layout section from its header bytes ``buf``.

    Returns (data start within the section, entries). ``fail(path, what)`` makes the
    error (a bundle's by default); ``align``: the alignment the data and each tensor
    must have (a bundle's 64; 1 for a plain safetensors file).
    """
    _fail = fail or _bundle_fail  # the bundle reader's error, or the caller's
    if len(buf) < 8:
        raise _fail(path, "weight section shorter than its length prefix")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_ST_HEADER or 8 + n > min(len(buf), section_size):
        raise _fail(path, f"weight header length {n} out of bounds")
    try:
        entries = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"weight header is not JSON: {e}") from None
    if not isinstance(entries, dict):
        raise _fail(path, "weight header is not a JSON object")
    entries.pop("__metadata__", None)
    data_start = 8 + n
    data_len = section_size - data_start
    if (base + data_start) % align:
        raise _fail(path, "weight data does not start on a 64-byte boundary")
    spans = []
    for name, e in entries.items():
        if not isinstance(e, dict):
            raise _fail(path, f"weight {name!r}: entry is not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in ST_DTYPES:
            raise _fail(path, f"weight {name!r}: unsupported dtype {dt!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _fail(path, f"weight {name!r}: bad shape {shape!r}")
        if not (
            isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
        ):
            raise _fail(path, f"weight {name!r}: bad data_offsets {offs!r}")
        b, e_ = offs
        if not (0 <= b <= e_ <= data_len):
            raise _fail(path, f"weight {name!r}: data_offsets {offs} outside the section")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(ST_DTYPES[dt]).itemsize
        if e_ - b != nbytes:
            raise _fail(path, f"weight {name!r}: {e_ - b} bytes for shape {shape} {dt}")
        if not name.startswith(PAD_PREFIX) and (base + data_start + b) % align:
            raise _fail(path, f"weight {name!r} is not {align}-byte aligned")
        spans.append((b, e_, name))
    spans.sort()
    pos = 0
    for b, e_, name in spans:
        if b != pos:
            raise _fail(path, f"weight {name!r} overlaps another or leaves a hole")
        pos = e_
    if pos != data_len:
        raise _fail(path, "weight section has trailing bytes no tensor accounts for")
    return data_start, entries


def _shape_ok(shape: object) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)


def _record_problem(rec: object, reserved: int, backends: tuple[str, ...]) -> str:
    """Why one kernel record (``kernel`` or its ``fallback``) cannot be bound as written,
    or "": a known backend, a name, the scratch it takes within what the plan reserved."""
    if not isinstance(rec, dict) or rec.get("backend") not in backends:
        return "unknown backend"
    if not isinstance(rec.get("name"), str) or not isinstance(rec.get("variant", ""), str):
        return "no kernel name"
    need = rec.get("scratch")
    if need is None:
        return "records no scratch size (a bundle from an older edgepack: rebuild it)"
    if not isinstance(need, int) or not 0 <= need <= reserved:
        return f"scratch {need!r} B is not within the {reserved} B the plan reserved"
    return ""


def _check_manifest(m: object, weights: dict, path: str) -> None:
    """Structural checks, so the executor never meets a dangling name or range."""
    from ..kernels import ops, wtypes
    from ..kernels.registry import BACKENDS, DTYPES

    if not isinstance(m, dict) or m.get("format") != "edgepack-bundle":
        raise _fail(path, "manifest is not an edgepack manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise _fail(
            path, f"manifest format version {m.get('format_version')!r}, expected {FORMAT_VERSION}"
        )

    def check_graph(g: dict, plan: dict, wspecs: dict) -> None:
        tensors = g["tensors"]
        arena = int(plan["arena_bytes"])
        for name, t in tensors.items():
            if not _shape_ok(t["shape"]) or t["dtype"] not in TENSOR_DTYPES:
                raise _fail(path, f"tensor {name!r}: bad shape or dtype")
            off = plan["tensors"][name]
            itemsize = np.dtype(TENSOR_DTYPES[t["dtype"]]).itemsize
            size = int(np.prod(t["shape"], dtype=np.int64)) * itemsize
            if not (isinstance(off, int) and 0 <= off and off % 4 == 0 and off + size <= arena):
                raise _fail(path, f"tensor {name!r} planned outside the arena")
        for node_name, span in plan["scratch"].items():
            off, size = span
            if not (
                isinstance(off, int)
                and isinstance(size, int)
                and 0 <= off
                and 0 <= size
                and off + size <= arena
            ):
                raise _fail(path, f"scratch of node {node_name!r} lies outside the arena")
        for io in g["inputs"] + g["outputs"]:
            if io["name"] not in tensors:
                raise _fail(path, f"graph input/output {io['name']!r} is not a tensor")
        for name in g.get("state", []):
            if name not in tensors:
                raise _fail(path, f"state {name!r} is not a tensor")
        for node in g["nodes"]:
            if node["op"] not in ops.OPS:
                raise _fail(
                    path,
                    f"node {node['name']!r}: unknown op {node['op']!r} "
                    "(bundle from a newer edgepack?)",
                )
            k = node["kernel"]
            if k["dtype"] not in DTYPES:
                raise _fail(path, f"node {node['name']!r}: unknown kernel {k}")
            reserved = plan["scratch"].get(node["name"], (0, 0))[1]
            for rec in (k, *([k["fallback"]] if "fallback" in k else [])):
                why = _record_problem(rec, reserved, BACKENDS)
                if why:
                    raise _fail(path, f"node {node['name']!r}: kernel record {rec}: {why}")
            for name in node["inputs"]:
                if name and name not in tensors and name not in wspecs:
                    raise _fail(path, f"node {node['name']!r} reads unknown tensor {name!r}")
            if k["dtype"] != "f32" and node["op"] in wtypes.WTYPES[k["dtype"]].ops:
                ins = list(node["inputs"]) + [""] * len(ops.OPS[node["op"]].roles)
                op = node["op"]
                w, s = wspecs.get(ins[ops.role(op, "w")]), wspecs.get(ins[ops.role(op, "scale")])
                if w is None or w["dtype"] != k["dtype"]:
                    raise _fail(path, f"node {node['name']!r}: its weight is not {k['dtype']}")
                why = wtypes.check_scale(k["dtype"], w["shape"], s and s["shape"])
                if why:
                    raise _fail(path, f"node {node['name']!r}: {why}")
            for name in node["outputs"]:
                if name not in tensors:
                    raise _fail(path, f"node {node['name']!r} writes unknown tensor {name!r}")
            shapes = [
                None if not t else tuple((tensors.get(t) or wspecs[t])["shape"])
                for t in node["inputs"]
            ]
            try:
                want = ops.output_shape(node["op"], shapes, node["attrs"])
            except ops.OpError as e:
                raise _fail(path, f"node {node['name']!r}: {e}") from None
            got = tuple(tensors[node["outputs"][0]]["shape"])
            if want != got:
                raise _fail(
                    path,
                    f"node {node['name']!r} ({node['op']}) writes {list(got)}; its inputs "
                    f"and attributes make {list(want)}",
                )

    try:
        wspecs = m["weights"]
        check_graph(m["graph"], m["plan"], wspecs)
        if "llm" in m:  # a language model's other graphs, planned on the same arena
            others = {"prefill": m["llm"]["prefill"]} | {
                f"decode of {r} rows": g for r, g in m["llm"].get("decode_rows", {}).items()}
            for what, pre in others.items():
                if pre["plan"]["arena_bytes"] != m["plan"]["arena_bytes"]:
                    raise _fail(path, f"the {what} and decode graphs plan different arenas")
                check_graph(pre["graph"], pre["plan"], wspecs)
                for name in m["graph"].get("state", []):  # the one KV cache they all use
                    here = (m["plan"]["tensors"][name], m["graph"]["tensors"][name])
                    there = (pre["plan"]["tensors"].get(name), pre["graph"]["tensors"].get(name))
                    if there != here:
                        raise _fail(path, f"state {name!r} differs between {what} and decode")
        for name, spec in wspecs.items():
            w = weights.get(name)
            if w is None or name.startswith(PAD_PREFIX):
                raise _fail(path, f"weight {name!r} listed in the manifest is missing")
            why = wtypes.check_stored(spec["dtype"], spec["shape"])
            if why:
                raise _fail(path, f"weight {name!r}: {why}")
            if list(w.shape) != list(spec["shape"]) or wtypes.st_dtype(spec["dtype"]) != w.dtype_st:
                raise _fail(path, f"weight {name!r}: manifest and weight header disagree")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _fail(path, f"manifest is malformed ({type(e).__name__}: {e})") from None


class _Spec:
    """Weight entry validated but not yet mapped (so manifest checks touch no data)."""

    def __init__(self, shape: list[int], dtype_st: str) -> None:
        self.shape, self.dtype_st = shape, dtype_st


def _sha256_range(f, start: int, length: int) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    f.seek(start)
    left = length
    while left:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            break
        h.update(view[:n])
        left -= n
    return h.digest()


def open_bundle(
    path: str | os.PathLike,
    offset: int = 0,
    size: int | None = None,
    header_check: Callable[[bytes], None] | None = None,
    verify_weights: bool = True,
) -> Bundle:
    """Validate the bundle stored at ``offset`` in ``path``, then map its weights.

    Everything (header, ranges, both checksums, the weight table, the manifest) is
    checked with plain reads; the file is mapped only once all of it holds.
    ``header_check`` sees the raw header first (signature checks). ``verify_weights``
    False skips only the weight section's sha256, for a caller that has already
    verified this very file (see runtime/verified.py).
    """
    p = str(path)
    try:
        with open(p, "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            f.seek(offset)
            raw_header = f.read(HEADER_SIZE)
            h = parse_header(raw_header, p)
            if header_check is not None:
                header_check(raw_header)
            available = (fsize - offset) if size is None else min(size, fsize - offset)
            _check_ranges(h, available, p)
            f.seek(offset + h.manifest_offset)
            mbytes = f.read(h.manifest_size)
            if hashlib.sha256(mbytes).digest() != h.manifest_sha256:
                raise _fail(p, "manifest checksum mismatch (corrupt or tampered)")
            wbase = offset + h.weights_offset
            if verify_weights and _sha256_range(f, wbase, h.weights_size) != h.weights_sha256:
                raise _fail(p, "weight checksum mismatch (corrupt or tampered)")
            f.seek(wbase)
            st_len = f.read(8)
            n = struct.unpack("<Q", st_len)[0] if len(st_len) == 8 else 0
            head = st_len + f.read(min(n, MAX_ST_HEADER + 1, h.weights_size))
            data_start, entries = parse_safetensors_header(
                memoryview(head), wbase, p, h.weights_size
            )
            try:
                manifest = json.loads(mbytes.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise _fail(p, f"manifest is not JSON: {e}") from None
            specs = {name: _Spec(e["shape"], e["dtype"]) for name, e in entries.items()}
            _check_manifest(manifest, specs, p)
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise BundleError(f"{p}: cannot read bundle: {e}") from None
    weights: dict[str, np.ndarray] = {}
    for name in manifest["weights"]:
        e = entries[name]
        dt = np.dtype(ST_DTYPES[e["dtype"]])
        count = int(np.prod(e["shape"], dtype=np.int64))
        start = wbase + data_start + e["data_offsets"][0]
        weights[name] = np.frombuffer(mm, dtype=dt, count=count, offset=start).reshape(e["shape"])
    return Bundle(p, offset, h, manifest, weights, mm)
