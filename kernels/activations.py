"""Activation epilogues shared by every backend.

An activation is carried in a node's attrs as ``act`` (a name from ``ACTIVATIONS``)
plus ``act_args`` (two floats; meaning per activation). Kernels that fuse an epilogue
take the integer code so numba can branch on it without Python objects.
"""

from __future__ import annotations

import numpy as np

# name -> code. Codes are part of the numba kernels' calling convention, not the
# bundle format (the bundle stores names).
ACTIVATIONS: dict[str, int] = {
    "none": 0,
    "relu": 1,
    "leaky_relu": 2,  # a = alpha
    "clip": 3,  # a = min, b = max
    "sigmoid": 4,
    "tanh": 5,
    "hard_sigmoid": 6,  # a = alpha, b = beta
    "hard_swish": 7,
    "silu": 8,  # x * sigmoid(x) (YOLO's and EfficientNet's SiLU / swish)
    "gelu": 9,  # x * (1 + erf(x / sqrt 2)) / 2 with a float32 rational erf (ERF_P, ERF_Q)
}
# erf(x) ~ x * P(x^2) / Q(x^2) on x clamped to [-4, 4] (Eigen's float erf): polynomials
# and one division, so the loop vectorises (numba's math.erf is a libm call per
# element: MiniLM's GELU took 14 of its 56 ms as the float64 math op). Largest error
# against math.erf, evaluated in float32: 4.2e-7 (1e-6 x |x| in GELU).
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
         -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
         -1.60960333262415e-02)  # fmt: skip
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
         -7.37332916720468e-03, -1.42647390514189e-02)  # fmt: skip

# tanh(x) ~ x * P(x^2) / Q(x^2) on x clamped to +-TANH_CLAMP (Eigen's float tanh, where
# the float32 result is +-1 already): largest error against float64 tanh, evaluated in
# float32, 3.4e-7 absolute and relative, accurate near 0 where 1 - 2 / (e^2x + 1) is not.
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
          5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
          4.89352455891786e-03)  # fmt: skip
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
          4.89352518554385e-03)  # fmt: skip
TANH_CLAMP = 7.90531110763549805
# e^x = 2^n e^r, n = round(x / ln2), r = x - n ln2 by Cody-Waite (ln2 in a high part exact
# to 11 bits and a low part) so |r| <= ln2 / 2, e^r by its Taylor series to r^7 (error
# r^8 / 8! < 2e-9), 2^n from the exponent bits; x clamped to [EXP_LO, EXP_HI] (e^-87 is
# near the normal floor, e^88.3 near the float32 ceiling; above it, inf). Sigmoid and SiLU are
# 1 / (1 + e^-x) and x / (1 + e^-x) on it: libm's expf, one call per element, kept
# those loops scalar.
EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO = 1.4426950408889634, 0.693145751953125, 1.4286068203094173e-06
EXP_TAYLOR = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)
EXP_LO, EXP_HI = -87.0, 88.3


def act_code(name: str) -> int:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def apply_act_ref(y: np.ndarray, act: str, args: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """Plain NumPy activation (returns a new array)."""
    a, b = float(args[0]), float(args[1])
    if act == "none":
        return y
    if act == "relu":
        return np.maximum(y, 0).astype(y.dtype)
    if act == "leaky_relu":
        return np.where(y >= 0, y, y * np.float32(a)).astype(y.dtype)
    if act == "clip":
        return np.clip(y, np.float32(a), np.float32(b)).astype(y.dtype)
    if act == "sigmoid":
        return (1.0 / (1.0 + np.exp(-y.astype(np.float64)))).astype(y.dtype)
    if act == "tanh":
        return np.tanh(y)
    if act == "hard_sigmoid":
        return np.clip(y * np.float32(a) + np.float32(b), 0, 1).astype(y.dtype)
    if act == "hard_swish":
        return (y * np.clip(y * np.float32(1 / 6) + np.float32(0.5), 0, 1)).astype(y.dtype)
    if act == "gelu":  # exact (math.erf in float64); -inf gives NaN (-inf * 0)
        from .mathfns import MATH_FNS

        with np.errstate(invalid="ignore"):
            return MATH_FNS["gelu"][1](y.astype(np.float64), 0.0, 0.0).astype(y.dtype)
    if act == "silu":  # -inf gives NaN, as x * sigmoid(x) does in ONNX Runtime
        with np.errstate(over="ignore", invalid="ignore"):
            y64 = y.astype(np.float64)
            return (y64 / (1.0 + np.exp(-y64))).astype(y.dtype)
    raise ValueError(f"unknown activation {act!r}")
