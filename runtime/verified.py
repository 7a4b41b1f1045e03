"""Remember which payloads were fully verified, so big ones are hashed once.

Checking a 1 GB weight section takes seconds on a board without SHA instructions.
After one full check the executable records the file's identity (device, inode,
size, mtime and ctime in ns, plus the checksums in its header); any write to the
file changes its ctime, so a tampered file no longer matches and is checked again.
``EDGEPACK_VERIFY=always`` checks on every start.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .. import cache_dir


def _marker(path: str, header: bytes) -> Path:
    st = os.stat(path)
    ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    key = hashlib.sha256(ident.encode() + header).hexdigest()[:32]
    return cache_dir() / "verified" / key


def is_verified(path: str, header: bytes) -> bool:
    if os.environ.get("EDGEPACK_VERIFY") == "always":
        return False
    try:
        return _marker(path, header).exists()
    except OSError:
        return False


def mark_verified(path: str, header: bytes) -> None:
    try:
        m = _marker(path, header)
        m.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        m.touch()
    except OSError:
        pass  # a read-only cache only costs the next start a full check
