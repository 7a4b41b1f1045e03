"""Load a bundle and run it: the one object the CLI, the agent and users hold."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .bundle import Bundle, open_bundle
from .executor import Executor
from .payload import Located, locate, verify_signature
from .threads import set_threads


def open_located(
    where: str | os.PathLike | Located,
    require_signature: bytes | None = None,
    verify_weights: bool = True,
) -> Bundle:
    """Open a bundle from a .epk path, an executable, or an already located payload;
    the signature (required key or embedded key) is checked before anything is mapped."""
    loc = where if isinstance(where, Located) else locate(where)
    return open_bundle(
        loc.path,
        offset=loc.offset,
        size=loc.size,
        header_check=lambda header: verify_signature(loc, header, require_signature),
        verify_weights=verify_weights,
    )


class Session:
    def __init__(
        self,
        path: str | os.PathLike | Located | Bundle,
        threads: int | None = None,
        require_signature: bytes | None = None,
        verify_weights: bool = True,
        device: str | None = None,
        require_gpu: bool = False,
        gpu_weights: str = "upload",
    ) -> None:
        """``device``: ``"cpu"``, ``"cuda"`` or None (as the bundle was planned); without a
        usable GPU a cuda bundle falls back to the cpu kernels with one warning, unless
        ``require_gpu``. ``gpu_weights``: ``"upload"`` (a device copy, made once) or
        ``"map"`` (the GPU reads the mmap'd file pages; for unified-memory boards)."""
        set_threads(threads)
        # an already opened bundle (serve's, after a look at its manifest) or a path
        self.bundle: Bundle = (
            path if isinstance(path, Bundle)
            else open_located(path, require_signature, verify_weights)
        )  # fmt: skip
        self.manifest = self.bundle.manifest
        self.executor = Executor(
            self.manifest,
            self.bundle.weights,
            device=device,
            require_gpu=require_gpu,
            gpu_weights=gpu_weights,
        )

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda"``: where this session's kernels run."""
        return self.executor.device.kind

    @property
    def inputs(self) -> list[dict]:
        return self.executor.inputs

    @property
    def outputs(self) -> list[dict]:
        return self.executor.outputs

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.executor.run(feeds)
