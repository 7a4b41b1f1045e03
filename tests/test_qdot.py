"""The int8-activation int4 GEMV (kernels/cpu/qdot.py) in every instruction family the
host can run: the same bits from each, and the reference's values.

The family is chosen when the kernel is compiled, from the CPU features (an AOT
target's, or the JIT host's); EDGEPACK_DOT_FEATURES names a subset of the host's so
that one machine compiles each family in turn, each in a fresh process and numba cache.
tests/test_kernels.py runs the host's own family over the xq cases; aarch64's ``sdot``
runs under qemu in tests/test_aarch64.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from edgepack.kernels import wtypes
from edgepack.kernels.cpu.qdot import dot_isa
from edgepack.kernels.cpu.simd import host_features
from edgepack.kernels.ref.reference import REFERENCE, node_weights

pytestmark = pytest.mark.cpu

# family -> the feature subset that selects it (generic: x86-64 without SSSE3's kin, so
# the half-precision scales take the integer conversion too)
FAMILIES = {
    "vnni512": "+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx2,+f16c",
    "vnni256": "+avx512f,+avx512vl,+avx512vnni,+avx2,+f16c",
    "avx2": "+avx2,+fma,+f16c",
    "generic": "+sse2,+sse",
}

RUN = r"""
import sys, numpy as np
from edgepack.kernels.cpu import qdot
from edgepack.kernels.cpu.abi import xq_scratch_layout, xq_scratch_views
x, w, s, b = (np.load(sys.argv[1] + f"/{n}.npy") for n in ("x", "w", "s", "b"))
for a in (x, w, s, b):
    a.flags.writeable = False
y = np.empty((x.shape[0], w.shape[0]), np.float32)
xq, nc, sx = xq_scratch_views(np.zeros(xq_scratch_layout(x.shape[0], w.shape[1] * 2)[1],
                                       np.uint8), x.shape[0], w.shape[1] * 2)
qdot.gemv_q4_q8(x, w, s, b, y, xq, nc, sx, 1, 1, 0.0, 0.0)  # bias, relu
np.save(sys.argv[1] + "/y.npy", y)
"""


def _runnable() -> list[str]:
    host = host_features()
    out = []
    for fam, feats in FAMILIES.items():
        need = {f[1:] for f in feats.split(",")}
        if dot_isa(need) == fam and need <= host | {"sse", "sse2"}:
            out.append(fam)
    return out


def test_every_family_gives_the_same_bits_and_the_reference(tmp_path):
    rng = np.random.default_rng(7)
    n, k, m = 37, 224, 3  # 7 blocks of 32: three pairs and a lone block; N % 4 == 1
    wf = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w, scale = wtypes.QUANTIZE["i4"](wf, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, :32] = 0  # a block of zeros: scale 0
    b = rng.standard_normal(n).astype(np.float32)
    for name, a in {"x": x, "w": w, "s": scale.view(np.uint16), "b": b}.items():
        np.save(tmp_path / f"{name}.npy", a)
    attrs = {"act": "relu", "act_args": [0.0, 0.0], "wshape": [n, k], "xq": 32}
    want = REFERENCE["linear"](node_weights("i4", [x, w, b, scale], "linear", attrs), attrs)
    got = {}
    for fam in _runnable():
        env = dict(os.environ, EDGEPACK_DOT_FEATURES=FAMILIES[fam],
                   NUMBA_CACHE_DIR=str(tmp_path / f"cache-{fam}"))  # fmt: skip
        subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], env=env, check=True,
                       timeout=600)  # fmt: skip
        got[fam] = np.load(tmp_path / "y.npy")
        np.testing.assert_allclose(got[fam], want, rtol=1e-4, atol=1e-5, err_msg=fam)
    assert "generic" in got and len(got) >= 2, got.keys()
    first = next(iter(got.values()))
    for fam, y in got.items():
        assert np.array_equal(y, first), f"{fam} differs from {next(iter(got))}"
