"""Binary layout of an ``.epk`` bundle (see docs/bundle-format.md).

All integers little-endian; all offsets relative to the start of the bundle so a
bundle can sit at any offset inside a larger file (e.g. appended to an executable).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"EPKB\r\n\x1a\n"  # PNG-style: text-mode transfers and truncation show up at once
# 2: conv_wino weights are stored U[a*a, Cin, Cout] (version 1: U[a*a, Cout, Cin])
# 3: nodes may run channels-last (attrs["layout"] == "nhwc", kernels/layout.py)
# 4: channels-last convs store their weights as GEMM panels (attrs["panel"])
FORMAT_VERSION = 4
ALIGN = 64
HEADER_STRUCT = struct.Struct("<8sIIQQQQQ32s32sI")  # + u32 crc32 of everything before it
HEADER_SIZE = HEADER_STRUCT.size + 4
assert HEADER_SIZE == 128, HEADER_SIZE  # layout pinned by tests/test_bundle_format.py

# safetensors dtype names -> numpy dtype strings for what bundles may hold (BF16 is
# mapped as its uint16 bit patterns). Which weight type each manifest entry is, and so
# which of these it is stored as, is kernels/wtypes.py's table.
ST_DTYPES: dict[str, str] = {
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I8": "i1",
    "U8": "u1",
    "I32": "<i4",
    "I64": "<i8",
    "BOOL": "|b1",
    "F64": "<f8",
    "I16": "<i2",
    "U32": "<u4",
    "U64": "<u8",
}
PAD_PREFIX = "__pad__."  # filler entries that keep every tensor 64-byte aligned
# Arena tensors' dtypes: float32 activations; int32 token ids, positions and slots;
# fp16 KV caches (an LLM graph's state); the integer, bool and float64 tensors of ONNX
# graphs (indices, masks, shapes, token ids) that the dtype-generic ops move and compare.
TENSOR_DTYPES: dict[str, str] = {
    "f32": "<f4", "i32": "<i4", "f16": "<f2", "i64": "<i8", "bool": "|b1", "u8": "|u1",
    "i8": "|i1", "i16": "<i2", "u16": "<u2", "u32": "<u4", "u64": "<u8", "f64": "<f8",
}  # fmt: skip
# numpy dtype -> arena dtype code
TENSOR_CODES: dict[np.dtype, str] = {np.dtype(v): k for k, v in TENSOR_DTYPES.items()}


@dataclass(frozen=True)
class Header:
    version: int
    bundle_size: int
    manifest_offset: int
    manifest_size: int
    weights_offset: int
    weights_size: int
    manifest_sha256: bytes
    weights_sha256: bytes
    flags: int = 0

    def pack(self) -> bytes:
        body = HEADER_STRUCT.pack(
            MAGIC,
            self.version,
            HEADER_SIZE,
            self.bundle_size,
            self.manifest_offset,
            self.manifest_size,
            self.weights_offset,
            self.weights_size,
            self.manifest_sha256,
            self.weights_sha256,
            self.flags,
        )
        return body + struct.pack("<I", zlib.crc32(body))


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a
