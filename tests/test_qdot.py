"""The int8-activation kernels (int4: kernels/cpu/qdot.py on canonical weights,
kernels/cpu/q4x16.py on weights interleaved by 16 rows; int8: kernels/cpu/q8x16.py) in
every instruction family the host can run: the same bits from each, and the
reference's values.

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
from edgepack.kernels import layout, wtypes
from edgepack.kernels.cpu.qdot import dot_isa
from edgepack.kernels.cpu.simd import host_features
from edgepack.kernels.ref.reference import REFERENCE, node_weights

pytestmark = [pytest.mark.cpu, pytest.mark.xdist_group("qdot")]  # one compile of generic

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
from edgepack.kernels.cpu import q4x16, q8x16, qdot
from edgepack.kernels.cpu.abi import xq_scratch_layout, xq_scratch_views
for kern, tag in ((qdot.gemv_q4_q8, ""), (q4x16.gemm_q4x16_q8, "16"), (q8x16.gemm_q8x16_q8, "8")):
    x, w, s, b = (np.load(sys.argv[1] + f"/{n}{tag}.npy") for n in ("x", "w", "s", "b"))
    for a in (x, w, s, b):
        a.flags.writeable = False
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    k = w.shape[1] * (1 if w.dtype == np.int8 else 2)
    xq, nc, sx = xq_scratch_views(np.zeros(xq_scratch_layout(x.shape[0], k)[1], np.uint8),
                                  x.shape[0], k)
    kern(x, w, s, b, y, xq, nc, sx, 1, 1, 0.0, 0.0)  # bias, relu
    np.save(sys.argv[2] + f"/y{tag}.npy", y)
"""


def _runnable() -> list[str]:
    host = host_features()
    out = []
    for fam, feats in FAMILIES.items():
        need = {f[1:] for f in feats.split(",")}
        if dot_isa(need) == fam and need <= host | {"sse", "sse2"}:
            out.append(fam)
    return out


RUNNABLE = _runnable()
# The default run compares the host's own family with the generic one; the families in
# between compile in the slow run (each family is a fresh compile of three kernels,
# ~40 s of one core).
DEFAULT = {RUNNABLE[0], "generic"} if RUNNABLE else {"generic"}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Inputs saved for the families' processes, and the reference's outputs."""
    d = tmp_path_factory.mktemp("qdot")
    rng = np.random.default_rng(7)
    n, k, m = 37, 224, 3  # 7 blocks of 32: three pairs and a lone block; N % 4 == 1
    wf = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w, scale = wtypes.QUANTIZE["i4"](wf, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, :32] = 0  # a block of zeros: scale 0
    b = rng.standard_normal(n).astype(np.float32)
    for name, a in {"x": x, "w": w, "s": scale.view(np.uint16), "b": b}.items():
        np.save(d / f"{name}.npy", a)
    attrs = {"act": "relu", "act_args": [0.0, 0.0], "wshape": [n, k], "xq": 32}
    want = REFERENCE["linear"](node_weights("i4", [x, w, b, scale], "linear", attrs), attrs)
    # interleaved: 3 groups of 16 rows, groups of 64 weights (a scale for two blocks),
    # 13 rows of x (tiles of 8, 4 and 1 where the family takes 8 rows, q4x16.tile_rows;
    # else 4, 4, 4 and 1), K ending inside a block
    n16, k16, m16 = 48, 200, 13
    wf16 = (rng.standard_normal((n16, k16)) / np.sqrt(k16)).astype(np.float32)
    w16, s16 = layout.q4_interleave(*wtypes.QUANTIZE["i4"](wf16, 64))
    x16 = rng.standard_normal((m16, k16)).astype(np.float32)
    b16 = rng.standard_normal(n16).astype(np.float32)
    for name, a in {"x16": x16, "w16": w16, "s16": s16.view(np.uint16), "b16": b16}.items():
        np.save(d / f"{name}.npy", a)
    a16 = {**attrs, "wshape": [n16, k16], "interleave": layout.Q4_INTERLEAVE}
    want16 = REFERENCE["linear"](node_weights("i4", [x16, w16, b16, s16], "linear", a16), a16)
    # int8 x int8 on rows interleaved by 16 (q8x16.py): 2 groups, 7 rows of x (tiles of
    # 4 and 3), extreme codes (-127 and 127: the VNNI path's w + 128 reaches 255)
    n8, k8, m8 = 32, 160, 7
    wf8 = (rng.standard_normal((n8, k8)) / np.sqrt(k8)).astype(np.float32)
    wf8[0, :40] = np.float32(10)
    wf8[1, :40] = np.float32(-10)
    w8, s8 = wtypes.QUANTIZE["i8"](wf8, 32)
    x8 = rng.standard_normal((m8, k8)).astype(np.float32)
    x8[2, 32:64] = 0
    b8 = rng.standard_normal(n8).astype(np.float32)
    for name, a in {"x8": x8, "w8": layout.q8_interleave(w8), "s8": s8, "b8": b8}.items():
        np.save(d / f"{name}.npy", a)
    a8 = {**attrs, "wshape": [n8, k8], "interleave": layout.Q4_INTERLEAVE}
    want8 = REFERENCE["linear"](node_weights("i8", [x8, layout.q8_interleave(w8), b8, s8],
                                             "linear", a8), a8)  # fmt: skip
    return d, (want, want16, want8), {}


def _outputs(fam: str, cases) -> tuple[np.ndarray, ...]:
    """The three kernels' outputs compiled for ``fam``, in a process and numba cache of
    its own (once per family in the module)."""
    d, _, done = cases
    if fam not in done:
        out = d / fam
        out.mkdir()
        env = dict(os.environ, EDGEPACK_DOT_FEATURES=FAMILIES[fam],
                   NUMBA_CACHE_DIR=str(d / f"cache-{fam}"))  # fmt: skip
        subprocess.run([sys.executable, "-c", RUN, str(d), str(out)], env=env, check=True,
                       timeout=600)  # fmt: skip
        done[fam] = tuple(np.load(out / f"y{tag}.npy") for tag in ("", "16", "8"))
    return done[fam]


@pytest.mark.parametrize("fam", [
    pytest.param(f, marks=() if f in DEFAULT else pytest.mark.slow) for f in FAMILIES
])  # fmt: skip
def test_each_family_gives_the_reference_and_the_generic_bits(fam, cases):
    if fam not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {fam} family")
    got = _outputs(fam, cases)
    for y, want, what in zip(got, cases[1], ("qdot", "q4x16", "q8x16")):
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5, err_msg=f"{fam} {what}")
    for y, y0, what in zip(got, _outputs("generic", cases), ("qdot", "q4x16", "q8x16")):
        assert np.array_equal(y, y0), f"{fam} differs from generic ({what})"


def test_join_concatenates_two_and_four_parts():
    """aarch64's sdot path of the interleaved kernel joins four 4-lane quarters (q4x16.py);
    joining them one after another made a shuffle of an 8- and a 4-lane vector, which
    llvmlite refused (found under qemu on a cortex-a76, where no host test reaches)."""
    import llvmlite.binding as llvm
    from edgepack.kernels.cpu.qdot import _join, _vec
    from llvmlite import ir

    i32 = ir.IntType(32)
    for count in (2, 4):
        mod = ir.Module(name=f"join{count}")
        fn = ir.Function(mod, ir.FunctionType(_vec(i32, 4 * count), [_vec(i32, 4)] * count), "f")
        b = ir.IRBuilder(fn.append_basic_block())
        out = _join(b, list(fn.args))
        assert out.type == _vec(i32, 4 * count)
        b.ret(out)
        llvm.parse_assembly(str(mod)).verify()
