"""ed25519 keys for signing bundles (PyNaCl / libsodium)."""

from __future__ import annotations

import base64
import os
from pathlib import Path


def keygen(stem: str | Path) -> tuple[Path, Path]:
    """Write STEM.key (private, mode 600) and STEM.pub; returns both paths."""
    from nacl.signing import SigningKey

    key = SigningKey.generate()
    priv, pub = Path(f"{stem}.key"), Path(f"{stem}.pub")
    for p in (priv, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists; refusing to overwrite a key")
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# edgepack ed25519 private key: keep it secret\n")
        f.write(base64.b64encode(bytes(key)).decode() + "\n")
    pub.write_text(
        "# edgepack ed25519 public key\n" + base64.b64encode(bytes(key.verify_key)).decode() + "\n"
    )
    return priv, pub
