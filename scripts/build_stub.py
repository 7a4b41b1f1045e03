"""Freeze the edgepack device runtime for a target (on a machine of its architecture).

    python scripts/build_stub.py --target linux-x86_64 [--out PATH]

The stub is model-independent and cached (~/.cache/edgepack/stubs/<target>-<version>/
by default, or $EDGEPACK_STUB_CACHE); `edgepack build MODEL --target T` appends a
bundle to it. See docs/executable.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgepack.packager.ir import PackError
from edgepack.packager.stub import build_stub
from edgepack.targets import TargetError, load_target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target name or .toml file")
    p.add_argument("--out", type=Path, help="where to write the stub (default: the cache)")
    a = p.parse_args(argv)
    try:
        build_stub(load_target(a.target), a.out)
    except (PackError, TargetError) as e:
        print(f"build_stub: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
