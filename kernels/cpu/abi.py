"""The calling convention of the CPU kernels, shared by the JIT and AOT builds.

The same kernel source (kernels/cpu/kernels.py) runs two ways: JIT-compiled by numba in a
development install, or compiled ahead of time into a plain extension module
(``edgepack_kernels``) that frozen device executables ship, so a device never
needs numba or LLVM. AOT exports have exactly one signature each, listed here;
kernels taking weights of several dtypes get one export per dtype.
"""

from __future__ import annotations

# Floats per worker slot of the GEMM's packed-column buffer (gemm_tiles.py): 256 KB,
# half an L2. Here, not in gemm_tiles, because planning scratch must not import numba.
GEMM_XP_FLOATS = 65536
# Floats per worker slot in which the pre-packed GEMM (gemmp) widens one slab of
# non-float32 panels: KD x PANEL (160 x 64), asserted in gemm_tiles.py.
GEMMP_SLAB_FLOATS = 160 * 64

# Activation block of the int8-activation int4 GEMV (qdot.gemv_q4_q8; a linear node's
# ``xq``), and its scratch: here, not in qdot, for the same reason.
XQ_BLOCK = 32


def xq_scratch_layout(rows: int, k_padded: int) -> tuple[int, int]:
    """(kp2, bytes) of gemv_q4_q8's scratch for ``rows`` rows of x and int4 weights padded
    to ``k_padded``: the quantized rows (int8), the lanes' offsets (int32) and scales
    (float32), kp2 bytes a row each, kp2 = k_padded rounded up to 64."""
    kp2 = -(-k_padded // (2 * XQ_BLOCK)) * 2 * XQ_BLOCK
    return kp2, 3 * rows * kp2


def xq_scratch_views(scratch, rows: int, k_padded: int):
    """(xq, nc, sx) carved from the front of ``scratch`` (uint8, 64-byte aligned)."""
    import numpy as np

    kp2, _ = xq_scratch_layout(rows, k_padded)
    n = rows * kp2
    xq = scratch[:n].view(np.int8).reshape(rows, kp2)
    nc = scratch[n : 2 * n].view(np.int32).reshape(rows, kp2 // 4)
    sx = scratch[2 * n : 3 * n].view(np.float32).reshape(rows, kp2 // 4)
    return xq, nc, sx


# The int8 x int8 GEMM (qgemm.py): rows a micro-tile takes, and the bytes a quantized
# image needs after its end (a kernel row's taps, padded to a multiple of 4, read them).
QGEMM_MR = 6
QGEMM_SLACK = 4


def qgemm_scratch_int64s() -> int:
    """int64s of qgemm's scratch per worker: its MR row offsets and one micro-tile of
    int32 sums (MR x 64)."""
    return QGEMM_MR + QGEMM_MR * 64 // 2


AOT_MODULE = "edgepack_kernels"


def stub_info() -> dict:
    """What packager/stub.py wrote into a frozen stub (target, kernel builds, thread
    cap); {} outside one."""
    try:
        import edgepack_stub_info  # written into the stub when it is frozen
    except ImportError:
        return {}
    return dict(edgepack_stub_info.INFO)


# A kernel with parallel loops is exported as a launcher on the native kernel pool
# (kernels/cpu/native_pool.py) under its name plus this, taking the pool's state first.
POOLED_SUFFIX = "_pooled"
POOL_STATE_LEN = 32 + 8 * 64  # int64s: native_pool.py's layout, MAX_THREADS = 64
POOL_WANT, POOL_STARTED = 24, 25  # its parts to use and threads running (caller included)
# and the polls a helper makes before it sleeps (0: native_pool.SPIN); pool.py sets it
POOL_SPIN = 26
# nonzero while the caller runs another pool's code (numpy's BLAS, pool.lend_cores):
# helpers then sleep instead of spinning, so that BLAS's own threads get the cores
POOL_PARK = 27
# Kernels generated per tile shape in gemm_tiles.py (``<name>_<lanes>x<vectors>``):
# builds export the target's shape under the plain name.
GEMM_TILE_KERNELS = ("gemm", "gemmp", "wino_conv", "dw3", "gemv_q4", "mbconv_rows")
# The float mbconv chain in one parallel region (gemm_tiles.mbconv_rows_*) is built for
# these (pointwise panels, depthwise weights as the kernel reads them) pairs, a chain
# of one weight type: fp16 and bf16 depthwise weights are widened to float32 before it
# runs, int8 ones read in place. Other mixes run in three kernels a band.
MBCONV_ROWS_TYPES = (("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("i8", "i8"))


def aot_signatures(gemm_shape: str = "8x2") -> dict[str, tuple[str, object]]:
    """export name -> (kernel function name in cpu_numba, or ``module.name`` for other
    kernel modules; numba signature). ``gemm_shape`` picks the target's GEMM tiles."""
    from numba import types as T

    def arr(dt, nd, layout="C", ro=False):
        return T.Array(dt, nd, layout, readonly=ro)

    f4, i8, i1, u1, u2, u4 = T.float32, T.int64, T.int8, T.uint8, T.uint16, T.uint32
    w1 = arr(f4, 1, ro=True)  # bias / scale / shift vectors (weights are read-only maps)
    v = T.void
    sigs: dict[str, tuple[str, object]] = {
        "im2col": ("im2col", v(arr(f4, 3), arr(f4, 2), *([i8] * 10))),
        "im2row": ("im2row", v(arr(f4, 3), arr(f4, 2), *([i8] * 10))),
        "to_channels_last": ("to_channels_last", v(arr(f4, 3), arr(f4, 3))),
        "swap_axes": ("swap_axes", v(arr(f4, 4, ro=True), arr(f4, 4))),
        "to_channels_first": ("to_channels_first", v(arr(f4, 3), arr(f4, 3))),
        "epilogue_cols": ("epilogue_cols", v(arr(f4, 2), w1, w1, i8, i8, f4, f4)),
        "act_into": ("act_into", v(arr(f4, 1), arr(f4, 1), i8, f4, f4)),
        "math_into": ("math_into", v(arr(f4, 1), arr(f4, 1), i8, T.float64, T.float64)),
        **{
            f"gemv_{name}": (  # int8, fp16 (uint16 bits), bf16 (int16 bits): gemv.py
                "gemv.gemv",
                v(arr(f4, 2, ro=True), arr(wdt, 2, ro=True), w1, w1, arr(f4, 2), i8, i8, f4, f4),
            )
            for name, wdt in (("i8", i1), ("f16", u2), ("bf16", T.int16))
        },
        **{
            name: (  # int4 x int8: canonical weights (qdot.py), rows interleaved (q4x16.py)
                src,
                v(arr(f4, 2, ro=True), arr(u1, 2, ro=True), arr(u2, 2, ro=True), w1,
                  arr(f4, 2), arr(i1, 2), arr(T.int32, 2), arr(f4, 2), i8, i8, f4, f4),
            )
            for name, src in (("gemv_q4_q8", "qdot.gemv_q4_q8"),
                              ("gemm_q4x16_q8", "q4x16.gemm_q4x16_q8"))
        },  # fmt: skip
        "gemm_q8x16_q8": (  # int8 x int8, rows interleaved (q8x16.py)
            "q8x16.gemm_q8x16_q8",
            v(arr(f4, 2, ro=True), arr(i1, 2, ro=True), arr(f4, 1, ro=True), w1, arr(f4, 2),
              arr(i1, 2), arr(T.int32, 2), arr(f4, 2), i8, i8, f4, f4),
        ),
        "maxpool": ("maxpool", v(arr(f4, 3), arr(f4, 3), *([i8] * 8))),
        "avgpool": ("avgpool", v(arr(f4, 3), arr(f4, 3), *([i8] * 9))),
        "global_avgpool": ("global_avgpool", v(arr(f4, 2), arr(f4, 1))),
        "maxpool_nhwc": ("nhwc.maxpool_nhwc", v(arr(f4, 3), arr(f4, 3), *([i8] * 8))),
        "global_avgpool_nhwc": ("nhwc.global_avgpool_nhwc", v(arr(f4, 2), arr(f4, 1))),
        "pad_nhwc": ("nhwc.pad_nhwc", v(arr(f4, 3), arr(f4, 3), i8, i8)),
        **{  # int8 ops' inputs and outputs: float32, or u8 codes (qgemm.py, qdw.py)
            f"quantize_pad_nhwc{sfx}": ("qgemm.quantize_pad_nhwc",
                                        v(arr(xdt, 3), arr(u1, 1), *([i8] * 6), f4, i8))
            for sfx, xdt in (("", f4), ("_u8", u1))
        },
        **{
            f"gemm_u8s8{sfx}": (
                "qgemm.gemm_u8s8",
                v(arr(u1, 1, ro=True), arr(i8, 1, ro=True), i8, i8, i8, arr(i1, 1, ro=True),
                  arr(T.int32, 1, ro=True), arr(ydt, 2, "A"), w1, w1, arr(f4, 2, "A"), i8, i8,
                  f4, f4, f4, f4, arr(i8, 2)),
            )
            for sfx, ydt in (("", f4), ("_u8", u1))
        },
        **{
            f"qdwconv3_{name}": (
                "qdw.qdwconv3",
                v(arr(f4, 3), arr(wdt, 4, ro=True), w1, w1, arr(u1, 3), *([i8] * 8), f4, f4,
                  f4, f4),
            )
            for name, wdt in (("f32", f4), ("i8", i1))
        },
        **{
            f"qmbconv_rows_{wn}{yn}": (  # the int8 chain, a band per thread (qmb.py)
                "qmb.qmbconv_rows",
                v(arr(u1, 1, ro=True), arr(i8, 1, ro=True), i8, i8, arr(i1, 1, ro=True),
                  arr(T.int32, 1, ro=True), w1, w1, i8, i8, f4, f4,
                  arr(wdt, 4, ro=True), w1, w1, i8, *([i8] * 6), i8, f4, f4, f4, f4,
                  i8, arr(i1, 1, ro=True), arr(T.int32, 1, ro=True), arr(ydt, 2), w1, w1,
                  arr(f4, 2, "A"), i8, i8, f4, f4, f4, f4,
                  i8, i8, i8, i8, arr(f4, 4), arr(u1, 2), arr(i8, 1, ro=True), arr(i8, 2)),
            )
            for wn, wdt in (("f32", f4), ("i8", i1))
            for yn, ydt in (("", f4), ("_u8", u1))
        },
        "channel_affine": ("channel_affine", v(arr(f4, 3), w1, w1, arr(f4, 3), i8, f4, f4)),
        "softmax3": ("softmax3", v(arr(f4, 3), arr(f4, 3), T.boolean)),
        "sdpa4": ("sdpa4", v(arr(f4, 4, ro=True), arr(f4, 4, ro=True), arr(f4, 4, ro=True),
                             arr(f4, 4, "A", ro=True), arr(f4, 4), arr(f4, 2), f4, T.boolean,
                             T.boolean, T.boolean)),
        "conv_transpose": ("conv_transpose", v(arr(f4, 4), arr(f4, 4, ro=True), w1, arr(f4, 4),
                                               *([i8] * 7), T.boolean)),
        "resample3": ("resample3", v(arr(f4, 3), arr(T.int32, 2, ro=True), arr(f4, 2, ro=True),
                                     arr(f4, 3))),
        "decode_i8": ("decode_i8", v(arr(i1, 1, ro=True), arr(f4, 1))),
        "decode_f16": ("decode_f16", v(arr(u2, 1, ro=True), arr(f4, 1))),
        "decode_bf16": ("decode_bf16", v(arr(u2, 1, ro=True), arr(u4, 1))),
        "decode_q4": (
            "decode_q4",
            v(arr(u1, 2, ro=True), arr(u2, 2, ro=True), arr(f4, 1), arr(i8, 1, ro=True),
              arr(i8, 1, ro=True)),
        ),
        "rnn_recur": (
            "rnn_recur",
            v(arr(f4, 2, ro=True), arr(f4, 2, "A", ro=True), arr(f4, 1, "A", ro=True),
              arr(f4, 3), arr(f4, 2, "A", ro=True), arr(f4, 1, "A", ro=True),
              arr(f4, 2, ro=True), arr(f4, 2, ro=True), arr(f4, 3), arr(f4, 2), arr(f4, 2),
              arr(f4, 2), arr(f4, 2), arr(f4, 2), arr(f4, 2), i8, i8, i8, i8, i8, i8),
        ),
        "binary_rows": (
            "binary_rows",
            v(arr(f4, 2, ro=True), arr(f4, 2, ro=True), arr(f4, 2), i8, i8, i8, f4, f4),
        ),
        "binary4": (
            "binary4",
            v(arr(f4, 4, "A", ro=True), arr(f4, 4, "A", ro=True), arr(f4, 4, "A"), i8, i8, f4, f4),
        ),
    }
    # decoder-LLM kernels (kernels/cpu/llm.py): token ids, positions and slots are int32
    f8, b1, i4 = T.float64, T.boolean, T.int32
    f2w, ids = arr(f4, 2), arr(i4, 1)
    sigs.update({
        "norm_rows": ("llm.norm_rows", v(f2w, w1, w1, f2w, f8, b1, b1, i8)),
        "rope_rows": ("llm.rope_rows", v(f2w, ids, arr(f4, 2, ro=True), arr(f4, 2, ro=True),
                                         f2w, i8, i8)),
        "glu_rows": ("llm.glu_rows", v(f2w, f2w, i8)),
        "halves_from_f32": ("llm.halves_from_f32", v(arr(u4, 1), arr(u2, 1))),
    })  # fmt: skip
    for name, wdt in (("f32", f4), ("i8", i1)):
        sigs[f"embed_rows_{name}"] = (
            "llm.embed_rows", v(ids, arr(wdt, 2, ro=True), w1, f2w, f8, b1, b1)
        )
    sigs["embed_rows_half"] = (  # fp16 / bfloat16 tables: their bits
        "llm.embed_rows_half", v(ids, arr(u2, 2, ro=True), f2w, arr(u4, 2), f8, b1)
    )
    for name, cdt in (("f32", f4), ("f16", u2)):  # KV caches: float32, or halves' bits
        sigs[f"attention_rows_{name}"] = (
            "llm.attention_rows",
            v(f2w, arr(u4, 2), ids, ids, arr(cdt, 4), arr(cdt, 4), f2w, arr(f4, 1), arr(f4, 1),
              i8, i8, i8, f8, i8, f8, b1),
        )  # fmt: skip
    a2 = arr(f4, 2, "A")  # GEMM operands may be bands of a larger plane
    f3, f2 = arr(f4, 3), arr(f4, 2)
    tiled = {
        "gemm": v(
            arr(f4, 2, ro=True), arr(f4, 2, "A", ro=True), a2, w1, w1, a2, i8, i8, f4, f4, f2
        ),
        "gemv_q4": v(arr(f4, 2, ro=True), arr(u1, 2, ro=True), arr(u2, 2, ro=True), w1,
                     arr(f4, 2), i8, i8, f4, f4),
    }
    for name, sig in tiled.items():
        sigs[name] = (f"gemm_tiles.{name}_{gemm_shape}", sig)
    for name, wdt in (("f32", f4), ("f16", u2), ("bf16", T.int16), ("i8", i1)):
        sfx = "" if name == "f32" else f"_{name}"  # panels of each weight type
        sigs[f"gemmp{sfx}"] = (
            f"gemm_tiles.gemmp_{gemm_shape}",
            v(arr(f4, 2, ro=True), arr(i8, 1, ro=True), i8, i8, i8, arr(wdt, 1, ro=True), a2,
              w1, w1, a2, i8, i8, f4, f4, i8, arr(f4, 2, ro=True)),
        )  # fmt: skip
        if name != "i8":  # Winograd's U: float32, fp16, bf16 (packager/conv_algo.py)
            sigs[f"wino_conv{sfx}"] = (
                f"gemm_tiles.wino_conv_{gemm_shape}",
                v(f3, f3, arr(wdt, 3, ro=True), f3, f3, f3, f2, f2, f3, *([i8] * 4), w1, w1,
                  f3, i8, i8, f4, f4, i8),
            )  # fmt: skip
    bits = {"f32": f4, "f16": u2, "bf16": T.int16, "i8": i1}
    for pw, dwt in MBCONV_ROWS_TYPES:
        wq, wdw = arr(bits[pw], 1, ro=True), arr(bits[dwt], 4, ro=True)
        sigs["mbconv_rows" + ("" if pw == "f32" else f"_{pw}")] = (
            f"gemm_tiles.mbconv_rows_{gemm_shape}",
            v(arr(f4, 4, ro=True), T.boolean, wq, w1, w1, i8, i8, f4, f4,
              wdw, w1, w1, i8, *([i8] * 6), i8, f4, f4,
              wq, arr(f4, 2), w1, w1, arr(f4, 2, ro=True), i8, i8, f4, f4,
              i8, arr(f4, 4), arr(f4, 4), arr(f4, 2, ro=True)),
        )  # fmt: skip
    for name, wdt in (("f32", f4), ("i8", i1)):
        special = v(
            *([arr(f4, 3), arr(wdt, 4, ro=True), w1, w1] + [arr(f4, 3)] * 3), i8, i8, f4, f4
        )
        for kern in ("dwconv3_flat", "dwconv3_s2"):  # 3x3 special cases (backend_cpu)
            sigs[f"{kern}_{name}"] = (kern, special)
        dwconv_sig = v(
            arr(f4, 3), arr(wdt, 4, ro=True), w1, w1, arr(f4, 3), arr(f4, 3), *([i8] * 8), f4, f4
        )
        for kern in ("dwconv", "nhwc.dwconv_nhwc"):  # planar, channels-last
            sigs[f"{kern.rpartition('.')[2]}_{name}"] = (kern, dwconv_sig)
        sigs[f"dw3_{name}"] = (f"gemm_tiles.dw3_{gemm_shape}", dwconv_sig)  # 3x3, vectors
    # every per-shape kernel is exported (dw3 once per weight dtype)
    assert set(tiled) | {"dw3", "gemmp", "wino_conv", "mbconv_rows"} == set(GEMM_TILE_KERNELS)
    return sigs
