"""Append a bundle to a runtime stub: one executable file per model and target.

Layout: stub | zero padding to 64 bytes | bundle | 128-byte trailer (bundle offset
and size, optional ed25519 signature and embedded public key). Nothing inside the
stub reads past its own archive, so the payload's size and bytes cannot disturb
start-up; the runtime finds the bundle through the trailer and maps it in place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..runtime.bundle_format import ALIGN, HEADER_SIZE, align_up
from ..runtime.payload import pack_trailer, signed_message


def sign_header(header: bytes, private_key: bytes) -> bytes:
    from nacl.signing import SigningKey

    return SigningKey(private_key).sign(signed_message(header)).signature


def append_trailer(
    path: Path, offset: int, size: int, private_key: bytes | None, pubkey: bytes | None
) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        header = f.read(HEADER_SIZE)
        sig = sign_header(header, private_key) if private_key else None
        f.seek(0, os.SEEK_END)
        f.write(pack_trailer(offset, size, sig, pubkey))


def assemble(
    stub: Path,
    bundle: Path,
    out: Path,
    private_key: bytes | None = None,
    pubkey: bytes | None = None,
) -> Path:
    """Write ``out`` = stub + bundle (+ trailer); streamed, so payload size is no limit."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as dst:
        with open(stub, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
        dst.write(b"\0" * (align_up(dst.tell(), ALIGN) - dst.tell()))
        offset = dst.tell()
        with open(bundle, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
        size = dst.tell() - offset
    append_trailer(tmp, offset, size, private_key, pubkey)
    tmp.chmod(0o755)
    os.replace(tmp, out)
    return out
