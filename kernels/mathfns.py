"""The ``math`` op's functions: ONNX's elementwise unary math, one row per function.

A node carries ``fn`` (a name below) and ``args`` (two floats, meaning per function).
Each row gives the integer code both backends branch on and the NumPy reference;
the scalar definition the backends compile is ``kernels/portable.py``'s ``math_fn``
(one function for numba CPU and numba CUDA, so they compute the same thing). Both
evaluate in float64 and round once to float32, as the reference does: these ops are
rare in hot paths, and one precision everywhere keeps the backends' answers equal.

NaN stays NaN and infinities follow IEEE (and ONNX Runtime): log(0) = -inf, 1/0 = inf,
a value outside a function's domain (sqrt(-1), acos(2)) gives NaN. ThresholdedRelu and
Shrink compare, so NaN (failing every comparison) gives 0 there, as in ONNX Runtime.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Ref = Callable[[np.ndarray, float, float], np.ndarray]

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf64(x: np.ndarray) -> np.ndarray:
    return _erf(x).astype(np.float64)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _shrink(x: np.ndarray, bias: float, lambd: float) -> np.ndarray:
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0.0))


# name -> (code, reference over float64)
MATH_FNS: dict[str, tuple[int, Ref]] = {
    "abs": (0, lambda x, a, b: np.abs(x)),
    "neg": (1, lambda x, a, b: -x),
    "exp": (2, lambda x, a, b: np.exp(x)),
    "log": (3, lambda x, a, b: np.log(x)),
    "sqrt": (4, lambda x, a, b: np.sqrt(x)),
    "reciprocal": (5, lambda x, a, b: 1.0 / x),
    "floor": (6, lambda x, a, b: np.floor(x)),
    "ceil": (7, lambda x, a, b: np.ceil(x)),
    "round": (8, lambda x, a, b: np.round(x)),  # halves to even, as ONNX
    "sign": (9, lambda x, a, b: np.sign(x)),
    "sin": (10, lambda x, a, b: np.sin(x)),
    "cos": (11, lambda x, a, b: np.cos(x)),
    "tan": (12, lambda x, a, b: np.tan(x)),
    "asin": (13, lambda x, a, b: np.arcsin(x)),
    "acos": (14, lambda x, a, b: np.arccos(x)),
    "atan": (15, lambda x, a, b: np.arctan(x)),
    "sinh": (16, lambda x, a, b: np.sinh(x)),
    "cosh": (17, lambda x, a, b: np.cosh(x)),
    "asinh": (18, lambda x, a, b: np.arcsinh(x)),
    "acosh": (19, lambda x, a, b: np.arccosh(x)),
    "atanh": (20, lambda x, a, b: np.arctanh(x)),
    "erf": (21, lambda x, a, b: _erf64(x)),
    "softplus": (22, lambda x, a, b: _softplus(x)),
    "softsign": (23, lambda x, a, b: x / (1.0 + np.abs(x))),
    "elu": (24, lambda x, a, b: np.where(x < 0, a * np.expm1(x), x)),  # a = alpha
    # a = alpha, b = gamma
    "selu": (25, lambda x, a, b: np.where(x <= 0, b * (a * np.exp(x) - a), b * x)),
    "celu": (26, lambda x, a, b: np.maximum(x, 0) + np.minimum(0, a * np.expm1(x / a))),
    "mish": (27, lambda x, a, b: x * np.tanh(_softplus(x))),
    "thresholded_relu": (28, lambda x, a, b: np.where(x > a, x, 0.0)),  # a = alpha
    "gelu": (29, lambda x, a, b: 0.5 * x * (1.0 + _erf64(x / math.sqrt(2.0)))),
    "gelu_tanh": (
        30,
        lambda x, a, b: 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "shrink": (31, lambda x, a, b: _shrink(x, a, b)),  # a = bias, b = lambd
}
assert len({c for c, _ in MATH_FNS.values()}) == len(MATH_FNS), "codes must differ"


def math_code(fn: str) -> int:
    try:
        return MATH_FNS[fn][0]
    except KeyError:
        raise ValueError(f"unknown math function {fn!r}; known: {', '.join(MATH_FNS)}") from None


def math_ref(x: np.ndarray, fn: str, args=(0.0, 0.0)) -> np.ndarray:
    """The reference: float64 evaluation, rounded once to float32."""
    a, b = float(args[0]), float(args[1])
    with np.errstate(all="ignore"):
        return np.asarray(MATH_FNS[fn][1](x.astype(np.float64), a, b)).astype(np.float32)
