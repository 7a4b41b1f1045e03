"""The .epk layout: pinned header bytes, zero-copy mapping, and refusal of corrupt files."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from edgepack.packager.writer import bundle_bytes, weights_section
from edgepack.runtime.bundle import BundleError, open_bundle
from edgepack.runtime.bundle_format import ALIGN, FORMAT_VERSION, HEADER_SIZE, HEADER_STRUCT, Header


def tiny_manifest() -> tuple[dict, dict[str, np.ndarray]]:
    """A hand-written one-op bundle: y = relu(x + c). Independent of the packager."""
    manifest = {
        "format": "edgepack-bundle",
        "format_version": FORMAT_VERSION,
        "graph": {
            "inputs": [{"name": "x", "shape": [1, 4], "dtype": "f32"}],
            "outputs": [{"name": "y", "shape": [1, 4], "dtype": "f32"}],
            "tensors": {
                "x": {"shape": [1, 4], "dtype": "f32"},
                "y": {"shape": [1, 4], "dtype": "f32"},
            },
            "nodes": [
                {
                    "name": "add",
                    "op": "binary",
                    "inputs": ["x", "c"],
                    "outputs": ["y"],
                    "attrs": {"kind": "add", "act": "relu", "act_args": [0.0, 0.0]},
                    "kernel": {
                        "backend": "cpu",
                        "dtype": "f32",
                        "name": "cpu.binary",
                        "scratch": 0,
                    },
                    "sources": ["add"],
                }
            ],
        },
        "weights": {"c": {"shape": [4], "dtype": "f32"}, "q": {"shape": [3], "dtype": "i8"}},
        "plan": {"arena_bytes": 128, "alignment": 64, "tensors": {"x": 0, "y": 64}, "scratch": {}},
    }
    weights = {"c": np.array([1, -2, 3, -4], np.float32), "q": np.array([1, 2, 3], np.int8)}
    return manifest, weights


# The 128 header bytes of tiny_manifest(), pinned: a change to the layout, the field
# order, the JSON serialisation or the weight section's padding shows up here.
GOLDEN_HEADER = bytes.fromhex(
    "45504b420d0a1a0a04000000800000000304000000000000"  # magic, version 4, header 128, size
    "8000000000000000"  # manifest offset
    "6b02000000000000"  # manifest size
    "0003000000000000"  # weights offset (64-aligned)
    "0301000000000000"  # weights size
    "e1d0b6eea0ae265291a730a8a33f5dc6b38bf79be2995169736d1251f4637d1a"  # sha256(manifest)
    "ba7793f6ed67bf4929af408d1ce5897f3c7373915fdba1d13f95f7faa6f51263"  # sha256(weights)
    "00000000"  # flags
    "886a784c"  # crc32 of the 124 bytes before it
)


def test_golden_header_bytes():
    manifest, weights = tiny_manifest()
    data = bundle_bytes(manifest, weights)
    assert data[:HEADER_SIZE] == GOLDEN_HEADER
    fields = HEADER_STRUCT.unpack_from(data)
    magic, version, hsize, bsize, moff, msize, woff, wsize, msha, wsha, flags = fields
    assert (magic, version, hsize, flags) == (b"EPKB\r\n\x1a\n", 4, 128, 0)
    assert bsize == len(data) and moff == HEADER_SIZE and woff % ALIGN == 0
    assert msha == hashlib.sha256(data[moff : moff + msize]).digest()
    assert wsha == hashlib.sha256(data[woff : woff + wsize]).digest()


def test_header_roundtrip():
    h = Header(FORMAT_VERSION, 1000, 128, 10, 192, 808, b"a" * 32, b"b" * 32)
    assert len(h.pack()) == HEADER_SIZE
    from edgepack.runtime.bundle import parse_header

    assert parse_header(h.pack()) == h


@pytest.fixture
def tiny_bundle(tmp_path):
    manifest, weights = tiny_manifest()
    p = tmp_path / "tiny.epk"
    p.write_bytes(bundle_bytes(manifest, weights))
    return p


def test_weights_are_zero_copy_views_of_the_file(tiny_bundle):
    b = open_bundle(tiny_bundle)
    base = np.frombuffer(b._mmap, np.uint8).ctypes.data
    data = tiny_bundle.read_bytes()
    for name, w in b.weights.items():
        assert not w.flags.owndata and not w.flags.writeable
        off = w.ctypes.data - base
        assert 0 <= off < len(data)
        assert off % ALIGN == 0, f"{name} not 64-byte aligned in the file"
        assert data[off : off + w.nbytes] == w.tobytes()
    np.testing.assert_array_equal(b.weights["c"], [1, -2, 3, -4])


def test_weight_section_is_valid_safetensors(tiny_bundle):
    from safetensors.numpy import load

    b = open_bundle(tiny_bundle)
    h = b.header
    section = tiny_bundle.read_bytes()[h.weights_offset : h.weights_offset + h.weights_size]
    loaded = load(section)
    for name, w in b.weights.items():
        np.testing.assert_array_equal(loaded[name], w)


def test_bundle_at_an_offset_inside_a_larger_file(tmp_path, tiny_bundle):
    p = tmp_path / "exe"
    prefix = b"\x7fELF" + b"\0" * 4092  # any prefix; offsets are bundle-relative
    p.write_bytes(prefix + tiny_bundle.read_bytes() + b"trailer")
    b = open_bundle(p, offset=len(prefix))
    np.testing.assert_array_equal(b.weights["c"], [1, -2, 3, -4])


def test_truncated_bundles_are_refused(tmp_path, tiny_bundle):
    data = tiny_bundle.read_bytes()
    cuts = list(range(0, HEADER_SIZE + 8)) + list(range(HEADER_SIZE + 8, len(data), 37))
    for cut in cuts:
        p = tmp_path / "cut.epk"
        p.write_bytes(data[:cut])
        with pytest.raises(BundleError):
            open_bundle(p)


def test_every_flipped_byte_is_refused(tmp_path, tiny_bundle):
    data = bytearray(tiny_bundle.read_bytes())
    p = tmp_path / "flip.epk"
    for pos in range(len(data)):
        if pos in range(HEADER_SIZE, len(data)) and _is_padding(data, pos):
            continue
        bad = bytearray(data)
        bad[pos] ^= 0x10
        p.write_bytes(bytes(bad))
        with pytest.raises(BundleError):
            open_bundle(p)


def _is_padding(data: bytearray, pos: int) -> bool:
    """Bytes between the manifest and the weight section carry nothing."""
    (msize,) = struct.unpack_from("<Q", data, 32)
    (woff,) = struct.unpack_from("<Q", data, 40)
    return HEADER_SIZE + msize <= pos < woff


def _rebundle(manifest: dict, section: bytes, mbytes: bytes | None = None) -> bytes:
    """Assemble a bundle with valid checksums around arbitrary contents (``mbytes``: the
    manifest's bytes as they are, JSON or not)."""
    mbytes = json.dumps(manifest).encode() if mbytes is None else mbytes
    woff = -(-(HEADER_SIZE + len(mbytes)) // ALIGN) * ALIGN
    h = Header(
        FORMAT_VERSION,
        woff + len(section),
        HEADER_SIZE,
        len(mbytes),
        woff,
        len(section),
        hashlib.sha256(mbytes).digest(),
        hashlib.sha256(section).digest(),
    )
    return h.pack() + mbytes + b"\0" * (woff - HEADER_SIZE - len(mbytes)) + section


@pytest.mark.parametrize(
    "case",
    [
        "overlap",
        "dtype",
        "missing",
        "arena",
        "shape",
        "notjson",
        "wtype",
        "packed",
        "outshape",
        "role",
        "backend",
        "scratch",
        "noscratch",
    ],
)
def test_structurally_bad_bundles_with_valid_checksums(tmp_path, case):
    manifest, weights = tiny_manifest()
    section = weights_section(weights, 0)
    (n,) = struct.unpack_from("<Q", section)
    head = json.loads(section[8 : 8 + n])
    data = section[8 + n :]
    if case == "overlap":
        head["q"]["data_offsets"] = [0, 3]  # inside c's [0, 16)
    elif case == "dtype":
        head["c"]["dtype"] = "C64"
    elif case == "missing":
        manifest["weights"]["nope"] = {"shape": [1], "dtype": "f32"}
    elif case == "arena":
        manifest["plan"]["tensors"]["y"] = 120
    elif case == "shape":
        manifest["weights"]["q"]["shape"] = [4]
    elif case == "wtype":  # not a row of the weight-type table
        manifest["weights"]["q"]["dtype"] = "i3"
    elif case == "outshape":  # the op table's shape function says [1, 4]
        manifest["graph"]["tensors"]["y"]["shape"] = [1, 5]
        manifest["graph"]["outputs"][0]["shape"] = [1, 5]
    elif case == "role":  # binary's second operand is not optional
        manifest["graph"]["nodes"][0]["inputs"] = ["x", ""]
    elif case == "backend":
        manifest["graph"]["nodes"][0]["kernel"]["backend"] = "tpu"
    elif case == "scratch":  # a kernel record needs more than the plan reserved
        manifest["graph"]["nodes"][0]["kernel"]["scratch"] = 64
    elif case == "noscratch":  # every record says what its kernel takes
        del manifest["graph"]["nodes"][0]["kernel"]["scratch"]
    elif case == "packed":  # int4 weights must hold whole runs of 32
        manifest["weights"]["q"]["dtype"] = "i4"
        head["q"]["dtype"] = "U8"
    if case != "notjson":
        hb = json.dumps(head).encode()
        hb += b" " * (-(8 + len(hb)) % ALIGN)
        section = struct.pack("<Q", len(hb)) + hb + data
    blob = _rebundle(manifest, section)
    if case == "notjson":
        blob = _rebundle(manifest, section, b"{not json" + b" " * 10)
    p = tmp_path / "bad.epk"
    p.write_bytes(blob)
    with pytest.raises(BundleError) as e:
        open_bundle(p)
    assert "not a valid edgepack bundle" in str(e.value)
    # each case fails for its own reason (a header of another version would mask them all)
    why = {
        "overlap": "overlaps another or leaves a hole",
        "dtype": "unsupported dtype 'C64'",
        "missing": "weight 'nope' listed in the manifest is missing",
        "arena": "planned outside the arena",
        "shape": "manifest and weight header disagree",
        "notjson": "manifest is not JSON",
        "wtype": "unknown weight type 'i3'",
        "packed": "int4 weights must be [N, K/2] with K a multiple of 32",
        "outshape": "writes [1, 5]; its inputs and attributes make [1, 4]",
        "role": "binary lacks its b input",
        "backend": "unknown backend",
        "scratch": "scratch 64 B is not within the 0 B the plan reserved",
        "noscratch": "records no scratch size",
    }
    assert why[case] in str(e.value)


def test_not_a_bundle(tmp_path):
    p = tmp_path / "x.epk"
    p.write_bytes(b"PK\x03\x04 this is a zip file" + b"\0" * 200)
    with pytest.raises(BundleError, match="bad magic"):
        open_bundle(p)
    with pytest.raises(BundleError, match="cannot read"):
        open_bundle(tmp_path / "missing.epk")
