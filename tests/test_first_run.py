"""The development install runs the CPU kernels compiled ahead of time at install
(setup.py, ``edgepack kernels``; kernels/cpu/aot_cache.py), so its first run compiles
nothing: which build it takes, that a stale one is never taken, and that the run gives
the JIT's bits with numba's cache left empty.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from edgepack.kernels.cpu import aot_cache, native

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[1]


def _fake_build(where: Path, name: str, flags: list[str], cpu: str, write_file: bool = True):
    d = where / name
    d.mkdir(parents=True)
    info = {"module": "edgepack_kernels", "cpu": cpu, "flags": flags, "file": f"{name}.so"}
    (d / aot_cache.BUILD_INFO).write_text(json.dumps(info))
    if write_file:
        (d / f"{name}.so").write_bytes(b"\x7fELF")


def test_the_digest_follows_every_compiled_kernel_source(tmp_path):
    kernels = Path(aot_cache.__file__).resolve().parents[1]
    copy = tmp_path / "kernels"
    shutil.copytree(kernels, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = aot_cache.kernel_sources_digest(copy)
    assert base == aot_cache.kernel_sources_digest(kernels)  # where they lie does not count
    tile = copy / "cpu" / "qdot.py"
    tile.write_text(tile.read_text() + "\n# an edit\n")
    assert aot_cache.kernel_sources_digest(copy) != base
    tile.write_text(tile.read_text().removesuffix("\n# an edit\n"))
    assert aot_cache.kernel_sources_digest(copy) == base
    (copy / "cpu" / "new_kernel.py").write_text("X = 1\n")  # a new file counts
    assert aot_cache.kernel_sources_digest(copy) != base
    (copy / "cpu" / "new_kernel.py").unlink()
    ref = copy / "ref" / "reference.py"  # the CPU build never imports ref/ or cuda/
    ref.write_text(ref.read_text() + "\n# an edit\n")
    assert aot_cache.kernel_sources_digest(copy) == base


def test_the_build_with_most_features_this_cpu_has_is_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPACK_CACHE_DIR", str(tmp_path))
    where = aot_cache.builds_dir()
    assert where.parent == tmp_path / "kernels" and aot_cache.kernel_sources_digest() in where.name
    _fake_build(where, "v4", ["avx2", "fma", "avx512f", "avx512vnni"], "x86-64-v4")
    _fake_build(where, "v3", ["avx2", "fma"], "x86-64-v3")
    _fake_build(where, "half", ["avx2"], "broken", write_file=False)  # interrupted: no .so
    _fake_build(where.with_name(where.name[:-4] + "0000"), "old", [], "stale")  # other sources
    assert [b["cpu"] for b in aot_cache.cached_builds()] == ["x86-64-v4", "x86-64-v3"]
    monkeypatch.setattr(aot_cache, "import_build", lambda b: b["cpu"])
    monkeypatch.setattr(native, "AOT_MODULE", "edgepack_kernels_absent")
    for flags, want in [("avx2 fma avx512f avx512vnni sse2", "x86-64-v4"),
                        ("avx2 fma avx512f sse2", "x86-64-v3"),  # no VNNI: v3
                        ("avx2 fma", "x86-64-v3")]:  # fmt: skip
        monkeypatch.setenv("EDGEPACK_CPU_FLAGS", flags)
        assert native._aot_build() == (want, want)
    monkeypatch.setenv("EDGEPACK_CPU_FLAGS", "sse2 avx")  # below every build: the JIT
    with pytest.raises(ImportError, match="no ahead-of-time kernel build"):
        native._aot_build()


def _run(args, env):
    r = subprocess.run([sys.executable, "-m", "edgepack.cli", *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.mark.xdist_group("frozen")  # the worker that makes the stub makes these builds too
def test_a_first_run_takes_the_install_kernels_and_compiles_nothing(tmp_path, digits_onnx):
    """With the builds in the cache (made at install; `edgepack kernels` makes them when
    missing, ~5 minutes, instantly otherwise), a process with an empty numba cache packs
    and runs the digits model on them, writes nothing to numba's cache, and gives the
    JIT's bits."""
    env = {k: v for k, v in os.environ.items() if k != "EDGEPACK_KERNELS"}  # auto
    r = _run(["kernels"], env)
    assert "runs the aot kernels built for" in r.stdout, r.stdout
    numba_cache = tmp_path / "numba-cache"
    numba_cache.mkdir()
    first = dict(env, NUMBA_CACHE_DIR=str(numba_cache), EDGEPACK_KERNELS="aot")  # or fail
    x = np.random.default_rng(3).standard_normal((1, 1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = {}
    for mode, e in (("aot", first), ("jit", dict(env, EDGEPACK_KERNELS="jit"))):
        bundle = tmp_path / f"digits-{mode}.epk"
        _run(["build", digits_onnx, "-o", bundle, "--quant", "int8"], e)
        _run(["run", bundle, "--input", tmp_path / "x.npy", "--output", tmp_path / f"{mode}.npz"],
             e)  # fmt: skip
        out[mode] = dict(np.load(tmp_path / f"{mode}.npz"))
    assert list(numba_cache.rglob("*")) == [], "the first run compiled kernels"
    for name, y in out["jit"].items():
        np.testing.assert_array_equal(out["aot"][name], y)
