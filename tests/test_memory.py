"""Memory: planned arena offsets are sound, the runtime allocates once, and the
steady-state loop allocates (next to) nothing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allocates_nothing, load, pack
from edgepack.runtime.bundle_format import ALIGN

pytestmark = pytest.mark.cpu


def _lifetimes(manifest: dict) -> dict[str, tuple[int, int]]:
    g = manifest["graph"]
    end = len(g["nodes"])
    life = {i["name"]: [-1, -1] for i in g["inputs"]}
    for k, n in enumerate(g["nodes"]):
        for o in n["outputs"]:
            life.setdefault(o, [k, k])
        for i in n["inputs"]:
            if i in life:
                life[i][1] = max(life[i][1], k)
    for o in g["outputs"]:
        life[o["name"]][1] = end
    return {k: tuple(v) for k, v in life.items()}


def assert_plan_sound(manifest: dict) -> None:
    g, plan = manifest["graph"], manifest["plan"]
    offs, arena = plan["tensors"], plan["arena_bytes"]
    life = _lifetimes(manifest)
    spans = []
    for name, (a, b) in life.items():
        size = int(np.prod(g["tensors"][name]["shape"])) * 4
        off = offs[name]
        assert off % ALIGN == 0 and off + size <= arena, name
        spans.append((name, off, off + size, a, b))
    index = {n["name"]: k for k, n in enumerate(g["nodes"])}
    for node, (off, size) in plan["scratch"].items():
        assert off % ALIGN == 0 and off + size <= arena
        spans.append((f"scratch:{node}", off, off + size, index[node], index[node]))
    alias = {n["outputs"][0]: n["inputs"][0] for n in g["nodes"]}
    for i, (n1, lo1, hi1, a1, b1) in enumerate(spans):
        for n2, lo2, hi2, a2, b2 in spans[i + 1 :]:
            if lo1 < hi2 and lo2 < hi1 and not (b1 < a2 or b2 < a1):
                # Sharing bytes while both are live is legal only for planned aliases
                # (reshape views, in-place elementwise ops) - exactly one hop apart.
                assert offs.get(n1) == offs.get(n2) and (
                    alias.get(n1) == n2 or alias.get(n2) == n1
                ), (n1, n2)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, model_dir, digits_onnx):
    import model_sources

    d = tmp_path_factory.mktemp("mem")
    return {
        "digits-int8": pack(digits_onnx, d / "d.epk", quant="int8"),
        "mobilenet_v2": pack(model_dir / "mobilenet_v2.onnx", d / "m.epk"),
        "rapidocr-int8": pack(
            model_sources.rapidocr_cls_model(),
            d / "r.epk",
            quant="int8",
            input_shapes={"x": (1, 3, 48, 192)},
        ),
    }


@pytest.mark.parametrize("name", ["digits-int8", "mobilenet_v2", "rapidocr-int8"])
def test_plan_is_sound_and_arena_allocated_once(bundles, name):
    s = load(bundles[name])
    assert_plan_sound(s.manifest)
    ex = s.executor
    assert ex.arena.nbytes == s.manifest["plan"]["arena_bytes"]
    assert ex.arena.ctypes.data % ALIGN == 0
    for v in ex.views.values():
        assert np.shares_memory(v, ex.arena)
    naive = sum(int(np.prod(t["shape"])) * 4 for t in s.manifest["graph"]["tensors"].values())
    naive += sum(size for _, size in s.manifest["plan"]["scratch"].values())
    assert ex.arena.nbytes < naive  # sharing happened


@pytest.mark.parametrize("name", ["digits-int8", "rapidocr-int8"])
def test_steady_state_loop_does_not_allocate(bundles, name):
    s = load(bundles[name])
    feeds = {
        i["name"]: np.random.default_rng(0).standard_normal(i["shape"]).astype(np.float32)
        for i in s.inputs
    }
    for _ in range(3):
        s.executor.run_views(feeds)  # warm-up: compiles, loads caches
    allocs = assert_allocates_nothing(lambda: s.executor.run_views(feeds))
    # numba's parallel loops allocate their schedule (two small arrays per call) and
    # free it before returning. A step makes up to 4 parallel calls (an int8 conv:
    # weight decode, im2col, GEMM, and a band more).
    assert allocs <= 110 * 2 * 4 * len(s.executor.steps), allocs
