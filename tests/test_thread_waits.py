"""How idle OpenMP and OpenBLAS threads wait (edgepack/__init__.py): decided per process,
before numpy loads, and a user's own setting wins, also in the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
CHILD = f"import edgepack, os; print(*(os.environ.get(k) for k in {KEYS!r}))"


def _run(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in KEYS and not k.startswith("EDGEPACK_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**clean, **env}, timeout=120, check=True)  # fmt: skip
    return r.stdout.split("\n")


def test_edgepack_first_spins_briefly_numpy_first_sleeps():
    assert _run(CHILD)[0].split() == ["active", "10000", "12"]
    assert _run("import numpy; " + CHILD)[0].split() == ["passive", "None", "12"]


def test_a_child_decides_afresh_unless_the_user_set_it():
    # a parent that loaded numpy first sleeps; the server it starts must not inherit that
    parent = ("import numpy, edgepack, subprocess, sys; "
              f"subprocess.run([sys.executable, '-c', {CHILD!r}])")
    lines = _run(parent)
    assert lines[0].split() == ["active", "10000", "12"]
    lines = _run(parent, OMP_WAIT_POLICY="passive")
    assert lines[0].split() == ["passive", "None", "12"]


def test_a_foreign_program_gets_the_users_environment():
    code = ("import numpy, edgepack, os; e = edgepack.foreign_environ(); "
            f"print(*(e.get(k) for k in {KEYS!r}))")
    assert _run(code)[0].split() == ["None", "None", "None"]
    assert _run(code, OMP_WAIT_POLICY="active")[0].split() == ["active", "None", "None"]


def test_blas_runs_on_the_caller_alone_where_numpy_came_first():
    """runtime/threads.py blas_threads: OpenBLAS loaded before edgepack spins 0.1 s after
    each call, so 2 kernel threads get a BLAS of 1; edgepack first (or the user's own
    OPENBLAS_THREAD_TIMEOUT) keeps BLAS at the kernels' count."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores for 2 kernel threads")
    code = ("from edgepack.runtime.threads import set_threads; "
            "from threadpoolctl import threadpool_info; set_threads(2); "
            "print(sorted({i['num_threads'] for i in threadpool_info() "
            "if i['user_api'] == 'blas'}))")  # fmt: skip
    assert _run("import numpy; " + code, EDGEPACK_KERNELS="jit")[0] == "[1]"
    assert _run(code, EDGEPACK_KERNELS="jit")[0] == "[2]"
    assert _run("import numpy; " + code, EDGEPACK_KERNELS="jit",
                OPENBLAS_THREAD_TIMEOUT="4")[0] == "[2]"  # fmt: skip
