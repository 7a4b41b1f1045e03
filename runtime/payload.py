"""Where the bundle sits in a file, and its optional ed25519 signature.

A bundle file (``.epk``) starts with the bundle header. A device executable is a
runtime stub with the bundle appended (64-byte aligned). Either may end with a
128-byte trailer that says where the bundle is and carries a signature over the
bundle header (which commits to the manifest's and the weights' sha256) and,
optionally, a public key embedded at build time. See docs/executable.md.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

from .bundle import BundleError
from .bundle_format import HEADER_SIZE, MAGIC

TRAILER_MAGIC = b"EPKTRLR1"
TRAILER = struct.Struct("<8sQQ64s32sI")  # + u32 crc32
TRAILER_SIZE = TRAILER.size + 4
assert TRAILER_SIZE == 128, TRAILER_SIZE
SIGNED, HAS_PUBKEY = 1, 2
SIGNATURE_CONTEXT = b"edgepack-bundle-signature-v1\0"


@dataclass(frozen=True)
class Located:
    path: str
    offset: int
    size: int | None  # None: up to the end of the file (a bare .epk)
    signature: bytes | None = None
    pubkey: bytes | None = None  # embedded at build time


def pack_trailer(offset: int, size: int, signature: bytes | None, pubkey: bytes | None) -> bytes:
    flags = (SIGNED if signature else 0) | (HAS_PUBKEY if pubkey else 0)
    body = TRAILER.pack(
        TRAILER_MAGIC, offset, size, signature or b"\0" * 64, pubkey or b"\0" * 32, flags
    )
    return body + struct.pack("<I", zlib.crc32(body))


def read_trailer(path: str) -> Located | None:
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if end < TRAILER_SIZE:
            return None
        f.seek(end - TRAILER_SIZE)
        raw = f.read(TRAILER_SIZE)
    if raw[:8] != TRAILER_MAGIC:
        return None
    if zlib.crc32(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
        raise BundleError(f"{path}: payload trailer is corrupt")
    _, off, size, sig, pub, flags = TRAILER.unpack_from(raw)
    if off + size > end - TRAILER_SIZE:
        raise BundleError(f"{path}: payload trailer points outside the file")
    return Located(
        path, off, size, sig if flags & SIGNED else None, pub if flags & HAS_PUBKEY else None
    )


def locate(path: str | os.PathLike) -> Located:
    """Find the bundle in a bare .epk or in a device executable."""
    p = str(path)
    try:
        t = read_trailer(p)
        if t is not None:
            return t
        with open(p, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise BundleError(f"{p}: cannot read bundle: {e}") from None
    if head == MAGIC:
        return Located(p, 0, None)
    raise BundleError(
        f"{p}: not a valid edgepack bundle: bad magic (this is not an .epk "
        "file or an edgepack executable)"
    )


def signed_message(header: bytes) -> bytes:
    assert len(header) == HEADER_SIZE
    return SIGNATURE_CONTEXT + header


def verify_signature(loc: Located, header: bytes, pubkey: bytes | None) -> None:
    """Refuse unless the bundle header is signed by ``pubkey`` (or the embedded key).

    With neither a required nor an embedded key, any signature is not checked."""
    key = pubkey or loc.pubkey
    if key is None:
        return
    if loc.signature is None:
        raise BundleError(
            f"{loc.path}: refused: the bundle is not signed, and a signature is required"
        )
    try:
        from nacl.exceptions import BadSignatureError
        from nacl.signing import VerifyKey
    except ImportError as e:  # pragma: no cover - packaging error
        raise BundleError(f"signature checks need PyNaCl, which this runtime lacks ({e})") from None
    try:
        VerifyKey(key).verify(signed_message(header), loc.signature)
    except (BadSignatureError, ValueError):
        raise BundleError(
            f"{loc.path}: refused: bad signature (not signed by the required "
            "key, or the bundle was altered)"
        ) from None


def read_key(path: str | os.PathLike, what: str = "public key") -> bytes:
    """A key file written by ``edgepack keygen``: one line of base64 (32 bytes)."""
    import base64
    import binascii

    try:
        text = open(path, encoding="ascii").read()
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: cannot read {what}: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    try:
        raw = base64.b64decode(lines[0].strip(), validate=True) if lines else b""
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise BundleError(f"{path}: not an edgepack {what} (expected 32 bytes of base64)")
    return raw
