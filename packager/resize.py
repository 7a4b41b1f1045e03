"""ONNX Resize as interpolation taps, one table per resized axis (the ``resample`` op).

Resize is separable: ONNX's reference interpolates axis by axis, each output element
a weighted sum of a few neighbours along one axis. For each axis this module computes,
at pack time, which input elements (``idx[out, taps]``, int32) and which weights
(``w[out, taps]``, float32) make each output element, following ONNX's reference
(onnx/reference/ops/op_resize.py) and, where the two differ, the operator text and ONNX
Runtime (``_x_ori``): the coordinate transformation, nearest's rounding
modes, linear and cubic coefficients (``cubic_coeff_a``), antialiased filters when
downsampling, ``exclude_outside``, and edge padding (neighbours past an end read the
end). The runtime then only gathers and sums.
"""

from __future__ import annotations

import math

import numpy as np

MODES = ("nearest", "linear", "cubic")
TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
              "asymmetric", "tf_crop_and_resize")  # fmt: skip
NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _x_ori(x: int, mode: str, scale: float, n_in: int, n_out: int, roi: tuple[float, float]):
    """The input coordinate of output element x (None: outside a crop's input), as the
    ONNX operator text and ONNX Runtime define it: the integer output length where the
    text says length_resized (align_corners, pytorch_half_pixel, tf_crop_and_resize;
    ONNX's Python reference uses scale * n_in there, which differs when the scale does
    not land on an integer)."""
    if mode == "align_corners":
        return 0.0 if n_out == 1 else x * (n_in - 1) / (n_out - 1)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        if n_out == 1:
            v = 0.5 * (lo + hi) * (n_in - 1)
        else:
            v = lo * (n_in - 1) + x * (hi - lo) * (n_in - 1) / (n_out - 1)
        return None if v < 0 or v > n_in - 1 else v
    if mode == "pytorch_half_pixel":
        return 0.0 if n_out == 1 else (x + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    # half_pixel_symmetric
    offset = n_in / 2 * (1 - n_out / (scale * n_in))
    return offset + (x + 0.5) / scale - 0.5


def _cubic(d: float, a: float) -> float:
    d = abs(d)
    if d <= 1:
        return (a + 2) * d**3 - (a + 3) * d**2 + 1
    if d < 2:
        return a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a
    return 0.0


def _coeffs(mode: str, r: float, scale: float, nearest: str, a: float, antialias: bool):
    """Weights of the taps floor - (n/2 - 1) ... floor + n/2 for fraction r in (0, 1]."""
    if mode == "nearest":
        if r == 1:
            return [0.0, 1.0]
        pick = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5,
                "floor": False, "ceil": True}[nearest]  # fmt: skip
        return [0.0, 1.0] if pick else [1.0, 0.0]
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        if s == 1.0:
            return [1 - r, r]
        start = math.floor(-1 / s) + 1
        c = [max(0.0, 1 - abs((i - r) * s)) for i in range(start, 2 - start)]
    else:
        if s == 1.0:
            return [_cubic(r + 1, a), _cubic(r, a), _cubic(1 - r, a), _cubic(2 - r, a)]
        start = math.floor(-2 / s) + 1
        c = [_cubic(s * (i - r), a) for i in range(start, 2 - start)]
    total = sum(c)
    return [v / total for v in c]


def axis_taps(n_in: int, n_out: int, scale: float, mode: str, transform: str,
              nearest: str = "round_prefer_floor", cubic_a: float = -0.75,
              exclude_outside: bool = False, antialias: bool = False,
              roi: tuple[float, float] = (0.0, 1.0)) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(idx[n_out, taps] int32, w[n_out, taps] float32) of one axis. Outputs outside a
    crop's input (tf_crop_and_resize) get all-zero weights: the extrapolation value 0."""
    rows: list[tuple[list[int], list[float]]] = []
    for x in range(n_out):
        xo = _x_ori(x, transform, scale, n_in, n_out, roi)
        if xo is None:
            rows.append(([0], [0.0]))
            continue
        f = math.floor(xo)
        r = xo - f
        if r == 0:  # the reference takes the pixel on the left with ratio 1
            f, r = f - 1, 1.0
        c = _coeffs(mode, r, scale, nearest, cubic_a, antialias)
        first = f - (len(c) // 2 - 1)
        idx = [first + k for k in range(len(c))]
        if exclude_outside and mode != "nearest":
            c = [v if 0 <= i < n_in else 0.0 for v, i in zip(c, idx)]
            total = sum(c)
            c = [v / total for v in c] if total else c
        rows.append(([min(max(i, 0), n_in - 1) for i in idx], c))  # edge padding
    if mode == "nearest":
        # nearest reads one pixel: its zero-weight neighbours go (a NaN there must not
        # reach the output, and one tap lets the kernel copy: PP-OCRv4's detector's
        # x2..x8 upsamplings took 48 ms of its 146 as two taps)
        rows = [([i for i, v in zip(ii, c) if v], [v for v in c if v]) or ([ii[0]], [0.0])
                if any(c) else ([ii[0]], [0.0]) for ii, c in rows]
    taps = max(len(i) for i, _ in rows)
    idx = np.zeros((n_out, taps), np.int32)
    w = np.zeros((n_out, taps), np.float32)
    for o, (i, c) in enumerate(rows):
        idx[o, : len(i)] = i
        w[o, : len(c)] = np.asarray(c, np.float64).astype(np.float32)
    return idx, w


def is_identity(idx: np.ndarray, w: np.ndarray, n_in: int) -> bool:
    """Taps that copy the axis as it is (a scale of 1 under most transforms)."""
    if idx.shape[0] != n_in:
        return False
    main = np.argmax(w, axis=1)
    ones = w[np.arange(n_in), main] == 1.0
    return bool(ones.all() and (idx[np.arange(n_in), main] == np.arange(n_in)).all()
                and (np.count_nonzero(w, axis=1) == 1).all())  # fmt: skip
