"""Channels-last (NHWC) nodes: what the ``layout`` attribute means, and how a backend
that only computes channels-first runs such a node.

The packager decides the layout (packager/layout.py): on CPU targets, conv-like ops
read and write ``[N, H, W, C]`` activations so that channels are the contiguous,
vectorised axis (a depthwise conv or a 1x1 conv on a 7x7 image fills whole vectors;
planar, a 7x7 plane wastes a quarter of each 16-lane vector). A node with
``attrs["layout"] == "nhwc"`` has:

- activation input 0, the residual (input 4 of the conv ops) and output 0 in
  ``[N, H, W, C]``, except ``global_avgpool``, whose ``[N, C, 1, 1]`` output has the
  same bytes either way and stays channels-first;
- ``dwconv`` weights in ``[kh, kw, 1, C]`` (HWIO); ``conv`` weights (group 1) in
  panels ``[ceil(Co/64), kh, kw, C, 64]`` (attributes ``panel`` = 64 and
  ``out_channels`` = Co; ``to_panels``):
  the HWIO matrix ``[kh*kw*C, Co]`` (row k one input tap, columns the output
  channels) cut into blocks of 64 columns, each stored whole, zero past Co. The CPU
  GEMM streams a panel front to back without repacking it per call;
  ``conv_wino`` weights unchanged (``U[a*a, C, Co]`` is already channels-last).

Whatever the layout, a float32 ``linear`` small enough that BLAS's call overhead
dominates it may store its weights as panels too (``linear_panels``): ``[ceil(N/64),
K, 64]``, the transposed ``[K, N]`` matrix in blocks of 64 columns, with attributes
``panel`` = 64 and ``out_features`` = N (packager/layout.py pack_panels).

An int4 ``linear`` with int8 activations (``xq``) and N a multiple of 16 may store its
packed weights and scales interleaved by 16 output rows (attribute ``interleave`` = 16,
``q4_interleave``; the kernel is kernels/cpu/q4x16.py): the same shapes and bytes as
canonical int4 (kernels/wtypes.py), reordered. An int8 ``linear`` (N a multiple of 16,
K of 32) may do the same with its int8 weights (``q8_interleave``; kernels/cpu/q8x16.py),
and so then does an ``embed`` reading the same table (a tied output projection): its
per-row scales stay as they are.

Only the cpu backend asks for the pass (kernels/registry.py ``BACKEND_TABLE``) and
binds these nodes; the reference computes them channels-first on transposed copies
(kernels/ref/reference.py), as the oracle the cpu kernels are tested against. The cuda
backend's kernels decline them and panel linears (``cpu_planned``): a cuda plan has
none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .ops import role

# Columns per panel of pre-packed GEMM weights (kernels/layout.py to_panels): a
# multiple of every tile shape's width (64 for AVX-512, 16 for AVX2 and NEON, 8 for SSE).
PANEL = 64
NHWC = "nhwc"
TO_NCHW = (0, 3, 1, 2)
TO_NHWC = (0, 2, 3, 1)
HWIO_FROM_OIHW = (2, 3, 1, 0)
OIHW_FROM_HWIO = (3, 2, 0, 1)
# Ops with a channels-last form, and which of their inputs are activations.
LAYOUT_OPS = ("conv", "dwconv", "conv_wino", "maxpool", "global_avgpool")
WEIGHT_IN_HWIO = ("conv", "dwconv")
# Ops whose nodes the cpu backend's passes may lay out for it alone (``cpu_planned``).
CPU_PLANNED_OPS = (*LAYOUT_OPS, "linear")


Q4_INTERLEAVE = 16  # output rows an interleaved int4 or int8 linear keeps side by side


def _rows16(a: np.ndarray, block_bytes: int) -> np.ndarray:
    """[N, cols] bytes, blocks of ``block_bytes`` a row -> per group of 16 rows and
    block, ``[d][row][4]``: run d holds bytes 4d..4d+3 of each row's block."""
    n, cols = a.shape
    r = Q4_INTERLEAVE
    if n % r or cols % block_bytes:
        raise ValueError(f"interleaving rows needs N % {r} == 0 and whole blocks of "
                         f"{block_bytes} bytes, got {n} x {cols}")  # fmt: skip
    p = a.reshape(n // r, r, cols // block_bytes, block_bytes // 4, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(p).reshape(n, cols)


def _rows16_undone(a: np.ndarray, block_bytes: int) -> np.ndarray:
    n, cols = a.shape
    r = Q4_INTERLEAVE
    p = a.reshape(n // r, cols // block_bytes, block_bytes // 4, r, 4).transpose(0, 3, 1, 2, 4)
    return np.ascontiguousarray(p).reshape(n, cols)


def q4_interleave(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical int4 weights ``[N, Kp/2]`` and scales ``[N, Kp/G]`` (N a multiple of
    16) -> the same shapes interleaved: per group of 16 rows, per block of 32 weights,
    256 bytes ``[d][row][4]`` (bytes 4d..4d+3 of each row's block: weights 4d..4d+3 in
    the low nibbles, 16+4d.. in the high ones), and per group and scale group the 16
    rows' scales side by side."""
    out = _rows16(packed, 16)  # raises first when N is not a multiple of 16
    r = Q4_INTERLEAVE
    s = scale.reshape(-1, r, scale.shape[1]).transpose(0, 2, 1)
    return out, np.ascontiguousarray(s).reshape(scale.shape)


def q4_deinterleave(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q4_interleave`` undone (copies)."""
    r = Q4_INTERLEAVE
    s = scale.reshape(-1, scale.shape[1], r).transpose(0, 2, 1)
    return _rows16_undone(packed, 16), np.ascontiguousarray(s).reshape(scale.shape)


def q8_interleave(w: np.ndarray) -> np.ndarray:
    """int8 weights ``[N, K]`` (N a multiple of 16, K of 32) -> the same shape
    interleaved: per group of 16 rows, per block of 32 weights, 512 bytes
    ``[d][row][4]`` (weights 4d..4d+3 of each row's block)."""
    return _rows16(w, 32)


def q8_deinterleave(w: np.ndarray) -> np.ndarray:
    """``q8_interleave`` undone (a copy)."""
    return _rows16_undone(w, 32)


def is_nhwc(attrs: dict) -> bool:
    return attrs.get("layout") == NHWC


def to_panels(hwio: np.ndarray) -> np.ndarray:
    """HWIO weights ``[kh, kw, C, Co]`` -> panels ``[ceil(Co/PANEL), kh, kw, C, PANEL]``
    (numpy; the packager's side)."""
    kh, kw, c, co = hwio.shape
    n = -(-co // PANEL)
    padded = np.zeros((kh, kw, c, n * PANEL), hwio.dtype)
    padded[..., :co] = hwio
    return np.ascontiguousarray(padded.reshape(kh, kw, c, n, PANEL).transpose(3, 0, 1, 2, 4))


def dot4_run(kw: int, c: int) -> int:
    """Reduction steps of 4 in one kernel row of a qconv: its kw * C taps, rounded up."""
    return -(-kw * c // 4)


def to_dot4_panels(hwio: np.ndarray) -> np.ndarray:
    """int8 HWIO weights ``[kh, kw, C, Co]`` -> a qconv's panels ``[ceil(Co/PANEL),
    kh * run4, PANEL, 4]`` (kernels/cpu/qgemm.py): per kernel row, its kw * C taps padded
    with zeros to run4 * 4, then byte j of column c in step k is tap 4k + j."""
    kh, kw, c, co = hwio.shape
    run4, n = dot4_run(kw, c), -(-co // PANEL)
    padded = np.zeros((kh, run4 * 4, n * PANEL), hwio.dtype)
    padded[:, : kw * c, :co] = hwio.reshape(kh, kw * c, co)
    p = padded.reshape(kh, run4, 4, n, PANEL).transpose(3, 0, 1, 4, 2)
    return np.ascontiguousarray(p).reshape(n, kh * run4, PANEL, 4)


def from_dot4_panels(p: np.ndarray, kh: int, kw: int, c: int, co: int) -> np.ndarray:
    """``to_dot4_panels`` undone: HWIO ``[kh, kw, C, Co]`` (a copy)."""
    n, _, width, _ = p.shape
    run4 = dot4_run(kw, c)
    w = p.reshape(n, kh, run4, width, 4).transpose(1, 2, 4, 0, 3).reshape(kh, run4 * 4, -1)
    return np.ascontiguousarray(w[:, : kw * c, :co]).reshape(kh, kw, c, co)


def linear_panels(w: np.ndarray) -> np.ndarray:
    """A linear's weights ``[N, K]`` -> panels ``[ceil(N/PANEL), K, PANEL]``: the GEMM
    operand ``[K, N]`` cut as ``to_panels`` cuts a 1x1 conv's."""
    n, k = w.shape
    return to_panels(np.ascontiguousarray(w.T).reshape(1, 1, k, n)).reshape(-1, k, PANEL)


def linear_weights(w, attrs: dict):
    """A linear's weights as ``[N, K]``, whether stored so or in panels (a copy then)."""
    if not attrs.get("panel"):
        return w
    n, k, width = w.shape
    return w.transpose(0, 2, 1).reshape(n * width, k)[: attrs["out_features"]]


def cpu_planned(attrs: dict) -> bool:
    """True for a node the packager laid out for the cpu backend alone (channels-last,
    weights in panels or interleaved); other backends decline it."""
    return is_nhwc(attrs) or bool(attrs.get("panel")) or bool(attrs.get("interleave"))


def from_panels(p, co: int):
    """Panels back to HWIO ``[kh, kw, C, Co]`` (a copy; the
    reference reads channels-last weights through it)."""
    n, kh, kw, c, width = p.shape
    return p.transpose(1, 2, 3, 0, 4).reshape(kh, kw, c, n * width)[..., :co]


def hwio_weights(w, attrs: dict):
    """A channels-last conv's weights as HWIO, whether stored so or in panels."""
    return from_panels(w, attrs["out_channels"]) if attrs.get("panel") else w


def node_weight_shape(op: str, wshape: Sequence[int], attrs: dict) -> tuple[int, ...]:
    """The float32 weight shape a node of ``op`` computes with, for logical (OIHW, or
    linear's [N, K]) weights ``wshape``: HWIO or panels when channels-last."""
    wshape = tuple(int(d) for d in wshape)
    if op not in WEIGHT_IN_HWIO or not is_nhwc(attrs):
        return wshape
    co, cg, kh, kw = wshape
    if attrs.get("panel"):
        return (-(-co // PANEL), kh, kw, cg, PANEL)
    return (kh, kw, cg, co)


def weight_offsets(op: str, wshape: Sequence[int], attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    """(row[N], col[K]) int64: weight (n, k) of the canonical [N, K] matrix (row n an
    output channel, k its reduction index in OIHW order) lives at flat offset
    row[n] + col[k] of the node's float32 weights (``node_weight_shape``). Backends
    decode weights stored canonical (int4) straight into the layout the node runs in."""
    n = int(wshape[0])
    k = int(np.prod(wshape[1:], dtype=np.int64))
    rows, cols = np.arange(n, dtype=np.int64), np.arange(k, dtype=np.int64)
    if op not in WEIGHT_IN_HWIO or not is_nhwc(attrs):
        return rows * k, cols
    _, cg, kh, kw = wshape
    c, rest = np.divmod(cols, kh * kw)
    tap = rest * cg + c  # (i * kw + j) * C + c: the HWIO row of reduction index k
    if attrs.get("panel"):
        panel = kh * kw * cg * PANEL
        return (rows // PANEL) * panel + rows % PANEL, tap * PANEL
    return rows, tap * n


def window(w_shape: Sequence[int], attrs: dict) -> tuple[int, int]:
    """(kh, kw) of a channels-last conv's weights from their stored shape alone (HWIO
    or panels): no need to unpack panels to look at them."""
    return tuple(w_shape[1:3]) if attrs.get("panel") else tuple(w_shape[:2])


def output_is_nhwc(op: str) -> bool:
    return op != "global_avgpool"


def activation_inputs(op: str, n_inputs: int) -> list[int]:
    """Indices of a channels-last node's inputs held in ``[N, H, W, C]``."""
    if op in ("maxpool", "global_avgpool"):
        return [0]
    res = role(op, "residual")  # conv, dwconv, conv_wino
    return [0] + ([res] if n_inputs > res else [])


def canonical_weights(attrs: dict) -> bool:
    """True when the node's weights are stored canonical whatever its layout (int4:
    kernels/wtypes.py; ``wshape`` is their logical shape)."""
    return "wshape" in attrs


def channels_first_attrs(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items()
            if k not in ("layout", "panel", "out_channels", "out_features")}  # fmt: skip


def dtype_name(dt) -> str:
    return {"float32": "f32", "float16": "f16", "int8": "i8"}.get(str(dt), str(dt))
