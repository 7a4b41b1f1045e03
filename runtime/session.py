"""Load a bundle and run it: the one object the CLI, the agent and users hold."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .bundle import Bundle, open_bundle
from .executor import Executor
from .threads import set_threads


class Session:
    def __init__(
        self,
        path: str | os.PathLike,
        threads: int | None = None,
        backend: str | None = None,
        offset: int = 0,
    ) -> None:
        set_threads(threads)
        self.bundle: Bundle = open_bundle(path, offset=offset)
        self.manifest = self.bundle.manifest
        self.executor = Executor(self.manifest, self.bundle.weights, backend=backend)

    @property
    def inputs(self) -> list[dict]:
        return self.executor.inputs

    @property
    def outputs(self) -> list[dict]:
        return self.executor.outputs

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.executor.run(feeds)
