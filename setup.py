"""setuptools hook: everything about the package is declared in pyproject.toml; this
file adds one step to the build, the CPU kernels compiled ahead of time into the kernel
cache (``edgepack kernels``; kernels/cpu/aot_cache.py), so that the first run after
``pip install`` starts at once instead of spending 36-84 s in numba's JIT.

The step runs in pip's build environment (numba and numpy are build requirements), in a
child process that imports the sources through a folder of links laid out as the
installed package (the source folders are mapped, pyproject's package-dir). It takes
about 5 minutes (two kernel builds, one per core), nothing when the cache already holds
builds of these kernel sources, and never fails the install: without builds the runtime
compiles with the JIT as before. EDGEPACK_INSTALL_KERNELS=0 skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# edgepack.<name> -> source folder, as pyproject.toml's package-dir (subpackages live
# inside their parent's folder)
TOP = {"runtime": "runtime", "packager": "packager", "kernels": "kernels", "targets": "targets"}
CHILD = """
from edgepack.packager.aot import ensure_kernel_builds, host_target
ensure_kernel_builds(host_target())
"""


def _linked_package(where: Path) -> None:
    pkg = where / "edgepack"
    pkg.mkdir()
    for f in (ROOT / "edgepack").iterdir():
        if f.suffix == ".py":
            (pkg / f.name).symlink_to(f)
    for name, folder in TOP.items():
        (pkg / name).symlink_to(ROOT / folder, target_is_directory=True)


class BuildWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("EDGEPACK_INSTALL_KERNELS", "1") == "0":
            return
        with tempfile.TemporaryDirectory(prefix="edgepack-setup-") as tmp:
            _linked_package(Path(tmp))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")]))
            print("edgepack: compiling the CPU kernels ahead of time (about 5 minutes; "
                  "EDGEPACK_INSTALL_KERNELS=0 skips it)", flush=True)  # fmt: skip
            r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tmp)
            if r.returncode:
                print("edgepack: WARNING: the ahead-of-time kernel build failed; the first "
                      "run will compile kernels with numba's JIT (`edgepack kernels` "
                      "retries)", file=sys.stderr, flush=True)  # fmt: skip


setup(cmdclass={"build_py": BuildWithKernels})
