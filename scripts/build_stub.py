"""Freeze the edgepack device runtime for a target: `edgepack stub`, kept under this
name for CI workflows (.github/workflows/stubs.yml) that call it.

    python scripts/build_stub.py --target linux-x86_64 [--out PATH]

See docs/executable.md.
"""

from __future__ import annotations

import sys

from edgepack.cli import main

if __name__ == "__main__":
    sys.exit(main(["stub", *sys.argv[1:]]))
