"""The weight-type table: one row per way a weight can be stored (ggml's type traits).

Everything that needs to know about weight storage asks this table: the CLI's
``--quant`` choices and the targets' ``default_quant`` (``QUANT_MODES``), the quantizer
(``quantize``), the NumPy reference (``dequantize``), the bundle reader (storage dtype
and block layout of every weight, ``check_stored``), the kernel registry (its dtype
keys) and the backends (the decoder each row names per backend). A name that is not a
row is an error everywhere (``get``), never a fallback.

Rows:

- ``f32``: float32, as trained.
- ``f16``: IEEE half.
- ``bf16``: bfloat16 (the top half of a float32; LLM checkpoints ship it), stored as
  the uint16 bit patterns (safetensors ``BF16``); rounded to nearest even.
- ``i8``: symmetric int8 in [-127, 127], one float32 scale per output channel (the
  node's ``scale`` input), per-channel along the weight's output axis.
- ``i4``: symmetric 4-bit, group-wise along the reduction axis: each output row's K
  weights (padded with zeros to whole groups) in groups of ``group`` (32, 64 or 128)
  sharing one fp16 scale; values q in [-8, 7] stored as q + 8, two per byte. Within
  each run of 32 weights, byte j holds weight j in its low nibble and weight j + 16 in
  its high nibble (ggml's Q4_0 order): a vector of bytes unpacks to two vectors of
  consecutive weights with one mask and one shift. Stored canonical ``[N, Kp / 2]``
  uint8 with scales ``[N, Kp / group]`` whatever the node's layout: the logical shape
  is the node attribute ``wshape``, and backends decode into the layout the node
  runs in (``layout.weight_offsets``).

Scale layouts: ``none``; ``channel`` (one per output channel, a separate float32
input); ``group`` (``[N, Kp / group]`` fp16, a separate input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 32
Q4_RUN = 32  # weights per nibble run (byte j: weight j low, weight j + 16 high)


@dataclass(frozen=True)
class WeightType:
    name: str  # the kernel registry's dtype key and the manifest's weight dtype
    quant: str | None  # its --quant mode (None: not a mode of its own)
    storage: np.dtype  # element dtype of the stored array
    st_dtype: str  # safetensors dtype name of the stored array
    per_element: int = 1  # weights per stored element (2: packed nibbles)
    scale: str = "none"  # "none" | "channel" | "group"
    scale_dtype: np.dtype | None = None
    # The references: (w float32, group size) -> (stored, scale input or None), and
    # (stored, scale, logical shape) -> float32 in that shape.
    quantize: Callable | None = None
    dequantize: Callable | None = None
    # Ops whose weights this type may store (the quantizer keeps others as before).
    ops: tuple[str, ...] = ("conv", "dwconv", "linear")
    # What consumes it on each backend: a decoder kernel's name in that backend's
    # kernel module ("" = read as is); "own" = dedicated kernels (registered per op).
    decoders: dict[str, str] = field(default_factory=dict)
    # Error of the stored form against float32, for docs and the table test: the
    # relative L2 of quantize -> dequantize on N(0, 1) weights stays under this.
    max_rel_error: float = 0.0
    describe: str = ""


def _i8_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: w ~= q * scale[c] (axis 0 is the channel)."""
    flat = w.reshape(w.shape[0], -1).astype(np.float64)
    amax = np.abs(flat).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    q = np.clip(np.rint(flat / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(w.shape), scale.astype(np.float32)


def _bf16_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, None]:
    """float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(w)
    out = rounded.astype(np.uint16)
    out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out, None


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def q4_padded_k(k: int, group: int) -> int:
    return -(-k // group) * group


def _q4_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, ...] (K = the rest) -> (packed uint8 [N, Kp / 2], fp16 scales [N, Kp / group]).

    Per group: d = m / -8 where m is the weight of largest magnitude (so m itself is
    exact at q = -8 and the other 15 levels cover the rest, as ggml's Q4_0 does);
    q = clip(round(w / d), -8, 7). The scale is rounded to fp16 before the weights are
    rounded against it, so stored scale and codes agree."""
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group}; choose from {GROUP_SIZES}")
    n = w.shape[0]
    flat = w.reshape(n, -1).astype(np.float32)
    k = flat.shape[1]
    kp = q4_padded_k(k, group)
    padded = np.zeros((n, kp), np.float32)
    padded[:, :k] = flat
    g = padded.reshape(n, kp // group, group)
    idx = np.abs(g).argmax(axis=2)
    m = np.take_along_axis(g, idx[..., None], axis=2)[..., 0]
    d = (m / -8.0).astype(np.float16)
    df = d.astype(np.float32)
    safe = np.where(df == 0, 1.0, df)
    q = np.clip(np.rint(g / safe[..., None]), -8, 7)
    q = np.where(df[..., None] == 0, 0, q).astype(np.int16) + 8  # 0..15
    runs = q.reshape(n, kp // Q4_RUN, 2, Q4_RUN // 2)  # [run, low/high half, 16]
    packed = (runs[:, :, 0] | (runs[:, :, 1] << 4)).astype(np.uint8)
    return packed.reshape(n, kp // 2), d


def q4_codes(packed: np.ndarray) -> np.ndarray:
    """Packed [N, Kp / 2] -> the signed codes [N, Kp] in weight order (int8)."""
    n, half = packed.shape
    runs = packed.reshape(n, half // (Q4_RUN // 2), Q4_RUN // 2)
    lo = (runs & 0x0F).astype(np.int8) - 8
    hi = (runs >> 4).astype(np.int8) - 8
    return np.concatenate([lo, hi], axis=2).reshape(n, half * 2)


def q4_group(packed_shape, scale_shape) -> int:
    """The group size of stored int4 weights, from their shapes."""
    return packed_shape[1] * 2 // scale_shape[1]


def _q4_dequantize(
    packed: np.ndarray, scale: np.ndarray, wshape: tuple[int, ...] | None = None
) -> np.ndarray:
    codes = q4_codes(np.asarray(packed)).astype(np.float32)
    n, kp = codes.shape
    group = q4_group(packed.shape, scale.shape)
    s = np.asarray(scale).astype(np.float32)
    w = (codes.reshape(n, kp // group, group) * s[..., None]).reshape(n, kp)
    if wshape is None:
        return w
    k = int(np.prod(wshape[1:], dtype=np.int64))
    return np.ascontiguousarray(w[:, :k]).reshape(wshape)



def channel_scaled(w: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """w as float32 times a per-output-channel (axis 0) scale, when there is one."""
    wf = np.asarray(w).astype(np.float32)
    if scale is not None:
        wf = wf * np.asarray(scale).reshape((-1,) + (1,) * (wf.ndim - 1)).astype(np.float32)
    return wf



ROWS: tuple[WeightType, ...] = (
    WeightType(
        "f32",
        "fp32",
        np.dtype("<f4"),
        "F32",
        quantize=lambda w, group: (np.ascontiguousarray(w, np.float32), None),
        dequantize=lambda w, s, wshape=None: np.asarray(w, np.float32),
        describe="float32 weights",
    ),
    WeightType(
        "f16",
        "fp16",
        np.dtype("<f2"),
        "F16",
        quantize=lambda w, group: (np.asarray(w).astype(np.float16), None),
        dequantize=lambda w, s, wshape=None: np.asarray(w).astype(np.float32),
        ops=("conv", "dwconv", "linear", "embed", "conv_wino"),
        decoders={"cpu": "decode_f16", "cuda": "decode_f16"},
        max_rel_error=1e-3,
        describe="fp16 weights, fp32 activations",
    ),
    WeightType(
        "bf16",
        "bf16",
        np.dtype("<u2"),
        "BF16",
        quantize=_bf16_quantize,
        dequantize=lambda w, s, wshape=None: bf16_to_f32(w),
        ops=("conv", "dwconv", "linear", "embed", "conv_wino"),
        decoders={"cpu": "decode_bf16", "cuda": "decode_bf16"},
        max_rel_error=8e-3,
        describe="bfloat16 weights (round to nearest even), fp32 activations",
    ),
    WeightType(
        "i8",
        "int8",
        np.dtype("i1"),
        "I8",
        scale="channel",
        scale_dtype=np.dtype("<f4"),
        quantize=_i8_quantize,
        dequantize=lambda w, s, wshape=None: channel_scaled(w, s),
        # a table row is an output channel; qconv: int8 x int8 (kernels/cpu/qgemm.py)
        ops=("conv", "dwconv", "linear", "embed", "qconv", "qdwconv"),
        decoders={"cpu": "decode_i8", "cuda": "decode_i8"},
        max_rel_error=2e-2,
        describe="int8: symmetric per-output-channel weights, fp32 scales, fp32 activations",
    ),
    WeightType(
        "i4",
        "int4",
        np.dtype("u1"),
        "U8",
        per_element=2,
        scale="group",
        scale_dtype=np.dtype("<f2"),
        quantize=_q4_quantize,
        dequantize=_q4_dequantize,
        ops=("conv", "linear"),
        decoders={"cpu": "own", "cuda": "own"},
        max_rel_error=0.15,
        describe="int4: symmetric group-wise weights (fp16 scale per group along K), "
        "fp32 activations",
    ),
)
WTYPES: dict[str, WeightType] = {r.name: r for r in ROWS}
QUANT_MODES: tuple[str, ...] = tuple(r.quant for r in ROWS if r.quant)
BY_QUANT: dict[str, WeightType] = {r.quant: r for r in ROWS if r.quant}
# The rows' references by name (tests and the packager call these).
QUANTIZE: dict[str, Callable] = {r.name: r.quantize for r in ROWS}
DEQUANTIZE: dict[str, Callable] = {r.name: r.dequantize for r in ROWS}

# Non-weight tensors a bundle may hold too (scales, tables, padding), by numpy dtype.
PLAIN_ST: dict[str, str] = {"i32": "I32", "u8": "U8", "i64": "I64", "bool": "BOOL", "f64": "F64",
                            "i16": "I16", "u32": "U32", "u64": "U64"}  # fmt: skip

assert all(r.quantize and r.dequantize for r in ROWS), "every row needs both references"
# Block layouts pinned at import (a change here changes every bundle's bytes).
assert Q4_RUN == 32 and all(g % Q4_RUN == 0 for g in GROUP_SIZES)
assert WTYPES["i4"].storage.itemsize * 8 == 4 * WTYPES["i4"].per_element
assert WTYPES["bf16"].storage.itemsize == 2 and WTYPES["f16"].storage.itemsize == 2


def get(name: str) -> WeightType:
    """The row named ``name``; an unknown name is an error naming the rows."""
    try:
        return WTYPES[name]
    except KeyError:
        raise KeyError(
            f"unknown weight type {name!r}; edgepack stores: {', '.join(WTYPES)}"
        ) from None


def by_quant(mode: str) -> WeightType:
    try:
        return BY_QUANT[mode]
    except KeyError:
        raise ValueError(f"--quant {mode!r}; choose from {', '.join(QUANT_MODES)}") from None


# numpy storage dtype -> row, for the rows a plain array identifies by itself (bundles
# hold no other uint16 tensors than bfloat16 weights). Packed rows (i4's uint8) never
# appear here: their arrays carry the type in the graph (Graph.wtypes) and the
# manifest, since a uint8 array could be anything.
_BY_STORAGE: dict[np.dtype, str] = {r.storage: r.name for r in ROWS if r.per_element == 1}
assert len(_BY_STORAGE) == sum(r.per_element == 1 for r in ROWS), "storage dtypes must differ"


def of_array(a: np.ndarray) -> str:
    """The type name of a constant that carries no explicit type: its numpy dtype's row,
    else the short numpy name of a plain tensor (``i32``, ``u8``)."""
    name = _BY_STORAGE.get(np.dtype(a.dtype))
    if name is not None:
        return name
    short = {np.dtype("<i4"): "i32", np.dtype("u1"): "u8", np.dtype("<i8"): "i64",
             np.dtype("|b1"): "bool", np.dtype("<f8"): "f64", np.dtype("<i2"): "i16",
             np.dtype("<u4"): "u32", np.dtype("<u8"): "u64"}.get(np.dtype(a.dtype))  # fmt: skip
    if short is None:
        raise ValueError(f"a constant of dtype {a.dtype} cannot be stored in a bundle")
    return short


def st_dtype(name: str) -> str:
    """The safetensors dtype a manifest dtype name is stored as."""
    if name in PLAIN_ST:
        return PLAIN_ST[name]
    return get(name).st_dtype


def check_stored(name: str, shape: list[int] | tuple[int, ...]) -> str | None:
    """What is wrong with a stored array of type ``name`` and ``shape`` (None: fine)."""
    row = WTYPES.get(name)
    if row is None:
        return None if name in PLAIN_ST else f"unknown weight type {name!r}"
    if row.name == "i4":
        if len(shape) != 2 or (shape[1] * 2) % Q4_RUN:
            return f"int4 weights must be [N, K/2] with K a multiple of {Q4_RUN}, got {shape}"
    return None


def check_scale(name: str, wshape, sshape) -> str | None:
    """What is wrong with the scale input of a weight of type ``name`` (None: fine)."""
    row = get(name)
    if row.scale == "group":
        if sshape is None:
            return "int4 weights need their group scales"
        if len(sshape) != 2 or sshape[0] != wshape[0] or not sshape[1]:
            return f"int4 scales {sshape} do not match weights {wshape}"
        if q4_group(wshape, sshape) not in GROUP_SIZES or wshape[1] * 2 % sshape[1]:
            return f"int4 scales {sshape}: group size not one of {GROUP_SIZES}"
    return None
