"""Write an ``.epk`` bundle: header, JSON manifest, safetensors-layout weights.

The weight section is a valid safetensors file on its own (``U8`` filler entries
named ``__pad__.N`` keep every real tensor on a 64-byte boundary, because
safetensors forbids holes between tensors). Output is deterministic: the same
inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..kernels.wtypes import of_array, st_dtype
from ..runtime.bundle_format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_SIZE,
    PAD_PREFIX,
    ST_DTYPES,
    Header,
    align_up,
)


def weights_section(
    weights: Mapping[str, np.ndarray],
    section_offset: int,
    types: Mapping[str, str] | None = None,
) -> bytes:
    """safetensors bytes whose tensors are 64-aligned once placed at ``section_offset``
    (itself 64-aligned) in the bundle. ``types``: the weight type of each tensor
    (kernels/wtypes.py; by default what its numpy dtype says), which fixes its
    safetensors dtype (bfloat16's uint16 bit patterns are ``BF16``)."""
    assert section_offset % ALIGN == 0
    entries: dict[str, dict] = {}
    chunks: list[bytes] = []
    pos = 0
    for k, name in enumerate(sorted(weights)):
        a = np.asarray(weights[name])
        a = a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d arrays 0-d
        try:
            t = (types or {}).get(name) or of_array(a)
            dt = st_dtype(t)
        except (KeyError, ValueError) as e:
            raise ValueError(f"weight {name!r}: {e.args[0]}") from None
        if np.dtype(ST_DTYPES[dt]) != a.dtype:
            raise ValueError(f"weight {name!r}: a {a.dtype} array cannot be stored as {t}")
        gap = align_up(pos) - pos
        if gap:
            entries[f"{PAD_PREFIX}{k}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [pos, pos + gap],
            }
            chunks.append(b"\0" * gap)
            pos += gap
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        entries[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    header = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    # Pad the JSON with spaces (allowed by safetensors) so the data starts aligned.
    n = align_up(8 + len(header)) - 8
    header += b" " * (n - len(header))
    return struct.pack("<Q", n) + header + b"".join(chunks)


def bundle_bytes(manifest: dict, weights: Mapping[str, np.ndarray]) -> bytes:
    mbytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    moff = HEADER_SIZE
    woff = align_up(moff + len(mbytes))
    types = {k: v["dtype"] for k, v in manifest.get("weights", {}).items()}
    wbytes = weights_section(weights, woff, types)
    total = woff + len(wbytes)
    h = Header(
        version=FORMAT_VERSION,
        bundle_size=total,
        manifest_offset=moff,
        manifest_size=len(mbytes),
        weights_offset=woff,
        weights_size=len(wbytes),
        manifest_sha256=hashlib.sha256(mbytes).digest(),
        weights_sha256=hashlib.sha256(wbytes).digest(),
    )
    pad = b"\0" * (woff - moff - len(mbytes))
    return h.pack() + mbytes + pad + wbytes


def write_bundle(path: str | os.PathLike, manifest: dict, weights: Mapping[str, np.ndarray]) -> int:
    """Write atomically (temp file + rename) so a crash never leaves half a bundle."""
    data = bundle_bytes(manifest, weights)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, p)
    return len(data)
