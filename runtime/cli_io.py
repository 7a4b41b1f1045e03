"""What the device commands share (run, info, bench, serve, and the client's submit):
reading input files, opening a session from command-line arguments, writing outputs.
Its own module so that ``serve`` and the client need not import the command table
(runtime/cli.py), which imports them."""

from __future__ import annotations

import argparse
import os

import numpy as np

from .executor import RunError


def load_inputs(path: str, inputs: list[dict]) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        raise RunError(f"--input {path}: no such file")
    if path.endswith(".npz"):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    if path.endswith(".npy"):
        if len(inputs) != 1:
            names = ", ".join(i["name"] for i in inputs)
            raise RunError(
                f"this model has {len(inputs)} inputs ({names}); pass an .npz keyed by input name"
            )
        return {inputs[0]["name"]: np.load(path)}
    raise RunError(f"--input {path}: expected a .npy or .npz file")


def _summary(name: str, y: np.ndarray) -> str:
    lines = [
        f"{name}: {y.dtype}[{'x'.join(map(str, y.shape))}] "
        f"min {y.min():.4g} max {y.max():.4g} mean {y.mean():.4g}"
    ]
    if y.ndim == 2 and 1 < y.shape[1] <= 100_000:
        for i, row in enumerate(y[:8]):
            top = np.argsort(row)[::-1][:3]
            best = ", ".join(f"{int(k)} ({row[k]:.4g})" for k in top)
            lines.append(f"  [{i}] prediction: class {int(top[0])}   top-3: {best}")
    return "\n".join(lines)


def pubkey(a: argparse.Namespace) -> bytes | None:
    from .payload import read_key

    return read_key(a.require_signature) if a.require_signature else None


def open_session(a: argparse.Namespace, bundle=None):
    """The session for ``a.bundle``: a path, or the payload of this executable (or
    ``bundle``, that one already opened)."""
    from .session import Session

    return Session(
        bundle if bundle is not None else a.bundle,
        threads=a.threads,
        require_signature=pubkey(a),
        verify_weights=getattr(a, "verify_weights", True),
        device=getattr(a, "compute_device", None),
        require_gpu=getattr(a, "require_gpu", False),
        gpu_weights=getattr(a, "gpu_weights", "upload"),
    )


def emit_outputs(outs: dict[str, np.ndarray], path: str | None) -> None:
    """Outputs to an .npz keyed by output name, or a readable summary on stdout."""
    if path:
        np.savez(path, **outs)
        print(f"wrote {len(outs)} output(s) to {path}")
    else:
        for k, v in outs.items():
            print(_summary(k, v))
