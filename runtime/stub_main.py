"""Entry point of a device executable: the frozen runtime with a bundle appended.

Same commands as ``edgepack`` (run, info, bench) without the BUNDLE argument: the
bundle is this file's own payload, found through the trailer at its end and mapped
zero-copy. The launcher passes the executable's path in ``EDGEPACK_SELF``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from .. import __version__
from ..kernels.cpu.abi import stub_info
from .bundle import BundleError
from .bundle_format import HEADER_SIZE
from .cli import ERRORS, add_runtime_commands, dispatch
from .payload import read_trailer
from .verified import is_verified, mark_verified


def main(argv: list[str] | None = None) -> int:
    exe = os.environ.get("EDGEPACK_SELF") or sys.executable
    prog = os.path.basename(exe)
    try:
        loc = read_trailer(exe)
        if loc is None:
            raise BundleError(
                f"{exe}: this executable carries no bundle (a bare runtime stub; "
                "use `edgepack build MODEL --target T` to make one)"
            )
        with open(exe, "rb") as f:
            f.seek(loc.offset)
            header = f.read(HEADER_SIZE)
    except (BundleError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    info = stub_info() or {"target": "unknown (not a frozen stub)"}
    version = (
        f"{prog}: edgepack {__version__}, target {info.get('target')}, "
        f"bundle {hashlib.sha256(header).hexdigest()[:16]}" + (", signed" if loc.signature else "")
    )
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--version"]:  # printed as is (argparse would re-wrap it)
        print(version)
        return 0
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the model packed into this executable (edgepack device runtime).",
    )
    parser.add_argument("--version", action="store_true", help="show versions and exit")
    add_runtime_commands(parser.add_subparsers(dest="command"), implicit=loc)
    # A payload is hashed in full once; afterwards only if the file changed.
    verified = is_verified(exe, header)
    parser.set_defaults(verify_weights=not verified)
    rc = dispatch(parser, argv, ERRORS)
    if rc == 0 and not verified:
        mark_verified(exe, header)
    return rc


if __name__ == "__main__":
    sys.exit(main())
