"""The ``edgepack`` command: ``build`` (packager) plus the device commands."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .packager.quantize import DEFAULT_MIN_WEIGHTS
from .runtime.cli import ERRORS, add_runtime_commands, dispatch


def cmd_build(a: argparse.Namespace) -> int:
    # The packager (and onnx) is imported only for this command.
    from .packager.build import build
    from .packager.onnx_import import parse_shape_overrides

    build(
        a.model,
        a.output,
        quant=a.quant,
        input_shapes=parse_shape_overrides(a.input_shape),
        calib=a.calib,
        max_error=a.max_error,
        min_weights=a.quant_min_weights,
    )
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgepack",
        description="Pack a trained model into a bundle for an edge device, and run it.",
    )
    parser.add_argument("--version", action="version", version=f"edgepack {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser(
        "build",
        help="pack an ONNX model into a .epk bundle",
        description="Import an ONNX model, fold and fuse, quantize, plan memory and write "
        "a bundle.",
    )
    p.add_argument("model", help="the .onnx model")
    p.add_argument("-o", "--output", required=True, help="the bundle to write (.epk)")
    p.add_argument(
        "--quant",
        choices=("fp32", "fp16", "int8"),
        default="fp32",
        help="weight storage (default fp32)",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=1x3x224x224",
        help="fix an input's shape (repeat for several inputs)",
    )
    p.add_argument(
        "--calib",
        help="calibration inputs (.npz keyed by input name, arrays "
        "[samples, *shape]); default: 8 seeded random inputs",
    )
    p.add_argument(
        "--max-error",
        type=float,
        metavar="X",
        help="fail if the quantized outputs' relative L2 error exceeds X",
    )
    p.add_argument(
        "--quant-min-weights",
        type=int,
        default=DEFAULT_MIN_WEIGHTS,
        metavar="N",
        help="layers with fewer weights stay fp32 (default "
        f"{DEFAULT_MIN_WEIGHTS}; 0 quantizes all)",
    )
    p.set_defaults(func=cmd_build)
    add_runtime_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .packager.ir import PackError

    return dispatch(make_parser(), argv, ERRORS + (PackError,))


if __name__ == "__main__":
    sys.exit(main())
