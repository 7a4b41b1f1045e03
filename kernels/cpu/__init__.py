"""The cpu backend: numba kernels (kernels.py, nhwc.py, the generated gemm_tiles.py on the
explicit SIMD vectors of simd.py), their calling convention shared with the AOT build
(abi.py), which build runs (native.py), and the binds (backend.py)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# the files above this one whose functions or constants numba compiles into the kernels
_COMPILED_FROM_PARENT = ("portable.py", "activations.py", "flags.py", "layout.py")


def _drop_stale_numba_cache() -> None:
    """numba's on-disk cache keys each function by its own file's timestamp only, yet
    the kernels inline helpers from the other files here (gemm_tiles.py's epilogues
    call kernels.py's act_row): after an edit or upgrade of one file, another's cached
    machine code would keep the old helper (a new activation code ran as SiLU). So
    the cache is dropped whenever any source here differs from the set it was built
    from (a hash of them all, beside the cache). A frozen executable unpacks into a
    folder named by its own hash and ships only some sources, so it has nothing stale."""
    if getattr(sys, "frozen", False):
        return
    here = Path(__file__).parent
    cache = here / "__pycache__"
    digest = hashlib.sha256()
    shared = [here.parent / f for f in _COMPILED_FROM_PARENT]
    for src in sorted(here.glob("*.py")) + shared:
        if not src.is_file():
            continue
        digest.update(src.name.encode() + src.read_bytes())
    stamp = cache / "edgepack-kernel-sources.sha256"
    want = digest.hexdigest()
    try:
        if stamp.read_text() == want:
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
        stamp.write_text(want)
    except OSError:  # a read-only install: numba then caches elsewhere or not at all
        pass


_drop_stale_numba_cache()
