"""GridSample's step for either backend (``xp``: NumPy, or the GPU's array module): the
samples of x at the run-time grid's points, over any number of spatial axes.

Per axis, as ONNX (and PyTorch, whose GridSampler.h it follows) defines it: the grid's
normalized coordinate (the last grid axis lists them innermost spatial axis first) is
mapped to pixels (align_corners: -1 and 1 are the corner pixels' centres, else their
outer edges); nearest rounds it half to even; a coordinate outside the borders is
clamped (border) or reflected (reflection); then each tap's index (1 for nearest, 2
for linear, 4 for cubic: Keys' kernel, a = -0.75) reads 0 outside x (zeros), the edge
(border) or its reflection (reflection). The weights of all taps multiply across
axes; the output is their weighted sum.

The step works on whole arrays of points, and so allocates its temporaries per run
(like TopK's sort): GridSample sits in a few detectors' heads, not in the hot loops.
"""

from __future__ import annotations

import itertools

import numpy as np

CUBIC_A = -0.75


def _reflect(xp, v, lo: float, hi: float):
    """v folded into [lo, hi] by reflecting at the nearer border, repeatedly."""
    rng = hi - lo
    if rng <= 0:
        return xp.full_like(v, lo)
    below, above = v < lo, v > hi
    d = xp.where(below, lo - v, v - hi)
    n = xp.floor(d / rng)
    r = d - n * rng
    even = (n % 2) == 0
    low_side = xp.where(even, lo + r, hi - r)
    high_side = xp.where(even, hi - r, lo + r)
    return xp.where(below, low_side, xp.where(above, high_side, v))


def _cubic(t):
    """Keys' four weights for a tap offset t in [0, 1): taps at -1, 0, 1, 2."""
    a = CUBIC_A

    def near(s):
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _borders(d: int, align: bool) -> tuple[float, float]:
    return (0.0, d - 1.0) if align else (-0.5, d - 0.5)


def grid_sample_step(xp, x, grid, y, attrs: dict):
    mode, pad, align = attrs["mode"], attrs["padding_mode"], bool(attrs["align_corners"])
    n, c, *dims = x.shape
    nd = len(dims)
    points = int(np.prod(grid.shape[1:-1], dtype=np.int64))
    src = x.reshape(n, c, -1)
    dst = y.reshape(n, c, points)
    g = grid.reshape(n, points, nd)
    strides = [int(np.prod(dims[i + 1 :], dtype=np.int64)) for i in range(nd)]

    def axis_taps(i: int):
        """(indices, weights) of axis i's taps, each [n, points]."""
        d = dims[i]
        v = g[:, :, nd - 1 - i].astype(np.float32)
        v = (v + 1) / 2 * (d - 1) if align else ((v + 1) * d - 1) / 2
        if mode == "nearest":
            v = xp.rint(v)
        lo, hi = _borders(d, align)
        if pad == "border":
            v = xp.where((v < lo) | (v > hi), xp.clip(v, 0, d - 1), v)
        elif pad == "reflection":
            v = _reflect(xp, v, lo, hi)
        if mode == "nearest":
            base, ws = v, [xp.ones_like(v)]
        else:
            base = xp.floor(v)
            t = v - base
            ws = [1 - t, t] if mode == "linear" else _cubic(t)
            base = base - (1 if mode == "cubic" else 0)
        out = []
        for k, w in enumerate(ws):
            idx, inside = base + k, None
            if pad == "zeros":  # outside x reads 0 (a mask, not a 0 weight: 0 * inf)
                inside = (idx >= 0) & (idx < d)
            elif pad == "reflection":
                idx = xp.trunc(_reflect(xp, idx, lo, hi))
            idx = xp.clip(idx, 0, d - 1)
            out.append((idx.astype(np.int64) * strides[i], w.astype(np.float32), inside))
        return out

    def step() -> None:
        per_axis = [axis_taps(i) for i in range(nd)]
        acc = xp.zeros((n, c, points), np.float32)
        for combo in itertools.product(*per_axis):
            flat = sum(idx for idx, _, _ in combo)
            w = combo[0][1]
            for _, wk, _ in combo[1:]:
                w = w * wk
            vals = xp.take_along_axis(src, xp.broadcast_to(flat[:, None, :], (n, c, points)), 2)
            masks = [m for _, _, m in combo if m is not None]
            if masks:
                inside = masks[0]
                for m in masks[1:]:
                    inside = inside & m
                vals = xp.where(inside[:, None, :], vals, 0)
            acc += vals * w[:, None, :]
        xp.copyto(dst, acc)

    return step
