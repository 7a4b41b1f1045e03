"""Memory: planned arena offsets are sound, the runtime allocates once, and the
steady-state loop allocates (next to) nothing."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import assert_allocates_nothing, load, pack
from edgepack.runtime.bundle_format import ALIGN, TENSOR_DTYPES

DTYPES = {k: np.dtype(v) for k, v in TENSOR_DTYPES.items()}

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


def _storage(manifest: dict) -> dict[str, tuple[str, int]]:
    """tensor -> (the tensor whose storage it is a view of, its byte offset there),
    following the views the plan may make: reshape outputs and contiguous slices
    always (packager/plan.py ALIAS_OPS), elementwise outputs where written in place."""
    from edgepack.packager.plan import ALIAS_OPS, INPLACE_OPS

    g, offs = manifest["graph"], manifest["plan"]["tensors"]
    parent: dict[str, tuple[str, int]] = {}
    for n in g["nodes"]:
        src = n["inputs"][0] if n["inputs"] else ""
        if src not in offs:
            continue
        t = g["tensors"][src]
        if n["op"] in ALIAS_OPS:
            at = ALIAS_OPS[n["op"]](t["shape"], n["attrs"])
        else:
            in_place = n["op"] in INPLACE_OPS and offs[n["outputs"][0]] == offs[src]
            at = 0 if in_place else None
        if at is not None:
            parent[n["outputs"][0]] = (src, at * DTYPES[t["dtype"]].itemsize)

    def resolve(t: str) -> tuple[str, int]:
        if t not in parent:
            return t, 0
        src, at = parent[t]
        r, d = resolve(src)
        return r, d + at

    return {t: resolve(t) for t in offs}


def assert_plan_sound(manifest: dict) -> None:
    g, plan = manifest["graph"], manifest["plan"]
    offs, arena = plan["tensors"], plan["arena_bytes"]
    life = _lifetimes(manifest)
    storage = _storage(manifest)
    spans = []
    for name, (a, b) in life.items():
        t = g["tensors"][name]
        size = int(np.prod(t["shape"])) * DTYPES[t["dtype"]].itemsize
        off = offs[name]
        root, at = storage[name]
        # a storage starts aligned; a view lies where its source says
        assert off == offs[root] + at and offs[root] % ALIGN == 0, name
        assert off + size <= arena, name
        spans.append((name, off, off + size, a, b))
    index = {n["name"]: k for k, n in enumerate(g["nodes"])}
    for node, (off, size) in plan["scratch"].items():
        assert off % ALIGN == 0 and off + size <= arena
        spans.append((f"scratch:{node}", off, off + size, index[node], index[node]))
    for i, (n1, lo1, hi1, a1, b1) in enumerate(spans):
        for n2, lo2, hi2, a2, b2 in spans[i + 1 :]:
            if lo1 < hi2 and lo2 < hi1 and not (b1 < a2 or b2 < a1):
                # Sharing bytes while both are live is legal only for planned views
                # of one storage (reshapes, contiguous slices, in-place elementwise ops).
                assert n1 in storage and n2 in storage, (n1, n2)
                assert storage[n1][0] == storage[n2][0], (n1, n2)


def test_contiguous_slices_are_views_and_copy_nothing(tmp_path):
    # A channel split at batch 1 and the last channel are contiguous blocks of their
    # input: planned as views at the block's offset, their steps bound to nothing; a
    # strided slice (every other column) still copies. Outputs as ONNX Runtime's.
    from conftest import ort_run
    from edgepack.kernels.ops import slice_block
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, [1, 6, 4, 5])
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "last", "odd")]
    c = helper.make_tensor("split", TensorProto.INT64, [2], [2, 4])
    consts = {n: helper.make_tensor(n, TensorProto.INT64, [len(v)], v) for n, v in {
        "s0": [5], "e0": [6], "ax": [1], "s1": [0], "e1": [5], "ax1": [3], "st": [2], "rax": [1],
    }.items()}  # fmt: skip
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Split", ["r", "split"], ["a", "b"], axis=1),
        helper.make_node("Mul", ["a", "a"], ["a2"]),
        helper.make_node("Sigmoid", ["b"], ["bs"]),
        helper.make_node("ReduceSum", ["bs", "rax"], ["bsum"], keepdims=1),
        helper.make_node("Add", ["bsum", "a2"], ["y0"]),
        helper.make_node("Concat", ["y0", "y0"], ["y"], axis=1),
        helper.make_node("Slice", ["r", "s0", "e0", "ax"], ["last"]),
        helper.make_node("Slice", ["r", "s1", "e1", "ax1", "st"], ["odd"]),
    ]
    graph = helper.make_graph(nodes, "views", [x], outs, [c, *consts.values()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 6, 4, 5)).astype(np.float32)}
    import onnx

    onnx.save(model, tmp_path / "v.onnx")
    s = load(pack(tmp_path / "v.onnx", tmp_path / "v.epk"))
    m = s.manifest
    assert_plan_sound(m)
    g, offs = m["graph"], m["plan"]["tensors"]
    slices = [n for n in g["nodes"] if n["op"] == "slice"]
    bound = {n["name"]: step for n, step in s.executor.bound}
    views = [n for n in slices if bound[n["name"]] is None]
    assert len(slices) == 4 and len(views) == 3, [n["attrs"] for n in slices]
    for n in views:
        src, out = n["inputs"][0], n["outputs"][0]
        at = slice_block(g["tensors"][src]["shape"], n["attrs"])
        assert offs[out] == offs[src] + 4 * at
    got = s.run(feeds)
    for name, want in zip(("y", "last", "odd"), ort_run(model, feeds)):
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)


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


@pytest.mark.parametrize("nbytes", [4096, (1 << 20) + 12345, 9 << 20])
def test_arenas_are_aligned_zeroed_and_large_ones_placed_in_huge_pages(nbytes):
    """runtime/device.py: every arena is exactly its planned size, ALIGN-aligned and
    zeroed; from HUGE_ARENA_MIN bytes it starts ARENA_SHIFT past a 2 MB boundary (the
    placement that keeps MobileNetV2's speed the same in every process), where the
    system has transparent huge pages."""
    import mmap

    from edgepack.runtime import device as D

    a = D.aligned_arena(nbytes)
    assert a.nbytes == nbytes and a.ctypes.data % ALIGN == 0 and a.flags.writeable
    assert not a.any()
    a[-1] = 7  # writable to its last byte
    if nbytes >= D.HUGE_ARENA_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
        assert a.ctypes.data % D.HUGE_PAGE == D.ARENA_SHIFT


def _pages_missing(a: np.ndarray) -> tuple[int, int]:
    """(pages of ``a`` not in memory, pages it spans), from mincore(2)."""
    import ctypes
    import mmap

    start = a.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = a.ctypes.data + a.nbytes - start
    vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(1 for v in vec if not v & 1), len(vec)


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mincore(2)")


@LINUX
@pytest.mark.parametrize("nbytes", [600_001, (1 << 20) + 12345, 9 << 20])  # 4 KB, 2 MB pages
def test_arenas_are_in_memory_before_the_first_run(nbytes):
    """runtime/device.py _fault_in: every page of a new arena is resident before anything
    writes it, so no run pays for a first touch (a 2 MB page may need compacting: 10-190
    ms in a serving step)."""
    from edgepack.runtime import device as D

    missing, pages = _pages_missing(D.aligned_arena(nbytes))
    assert missing == 0, f"{missing} of {pages} pages not in memory"


@LINUX
def test_fault_in_reaches_the_last_page_of_an_arena_that_starts_inside_a_page():
    import mmap

    from edgepack.runtime import device as D

    m = mmap.mmap(-1, 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)[mmap.PAGESIZE - 96 : mmap.PAGESIZE + 104]  # two pages
    assert _pages_missing(a) == (2, 2)
    D._fault_in(a)
    assert _pages_missing(a) == (0, 2)
    del a
