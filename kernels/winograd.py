"""Winograd convolution F(m x m, 3 x 3) (Lavin & Gray, 2015): the transforms and a reference.

A 3x3 stride-1 convolution computes each m x m output tile from an a x a input tile
(a = m + 2) with a*a multiplies per (in, out) channel pair instead of 9*m*m: 2.25x
fewer for m = 2, 4x fewer for m = 4. In matrix form, per tile and channel pair::

    Y = AT [ (G g GT) * (BT d B) ] A          (* is elementwise)

The packager transforms the weights once (``transform_weights``: U = G g GT, stored in
the bundle as U[a*a, Cin, Cout]); at run time the input transform, a*a independent
GEMMs V[e] @ U[e] (V[e]: tiles x Cin) and the output transform run per image
(kernels/cpu/gemm_tiles.py, vectorised along channels, so U[e]'s rows are output channels).

Numerics: the m = 4 transforms have coefficients up to 8 (AT) and 1/24 (G); in
float32 the output error is ~1e-6 relative on ResNet-sized layers (measured in
tests/test_kernels.py against the float64 direct reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The standard matrices for interpolation points 0, +-1 (m=2) and 0, +-1, +-2 (m=4).
_F2 = {
    "BT": [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
    "G": [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
    "AT": [[1, 1, 1, 0], [0, 1, -1, -1]],
}
_F4 = {
    "BT": [
        [4, 0, -5, 0, 1, 0],
        [0, -4, -4, 1, 1, 0],
        [0, 4, -4, -1, 1, 0],
        [0, -2, -1, 2, 1, 0],
        [0, 2, -1, -2, 1, 0],
        [0, 4, 0, -5, 0, 1],
    ],
    "G": [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    "AT": [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
}
TILES = {2: _F2, 4: _F4}


# Weight types a Winograd conv stores its transformed weights U in: float32, or fp16 /
# bf16 when the conv's weights are (U rounded to the type once at pack time; its error
# shows in the build's error table). Not int8: a per-output-channel scale cannot cover
# U, whose a*a elements of one filter differ in range.
WEIGHT_TYPES = ("f32", "f16", "bf16")


def matrices(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(BT, G, AT) for F(m, 3) as float64: BT[a, a], G[a, 3], AT[m, a]."""
    try:
        t = TILES[m]
    except KeyError:
        raise ValueError(f"Winograd tile {m}: supported {sorted(TILES)}") from None
    return tuple(np.array(t[k], np.float64) for k in ("BT", "G", "AT"))  # type: ignore[return-value]


def _check_1d(m: int) -> None:
    # F(m, 3) in 1-D must equal the direct correlation: checked once per m at import,
    # so a typo in a matrix cannot ship.
    bt, g, at = matrices(m)
    rng = np.random.default_rng(m)
    d, w = rng.standard_normal(m + 2), rng.standard_normal(3)
    direct = np.array([d[i : i + 3] @ w for i in range(m)])
    assert np.allclose(at @ ((g @ w) * (bt @ d)), direct, atol=1e-12), f"F({m},3) matrices"


for _m in TILES:
    _check_1d(_m)


def transform_weights(w: np.ndarray, m: int) -> np.ndarray:
    """w[Cout, Cin, 3, 3] -> U[a*a, Cin, Cout] float32 (U[e] is the GEMM's right operand)."""
    _, g, _ = matrices(m)
    a = m + 2
    u = np.einsum("ik,ockl,jl->ijco", g, w.astype(np.float64), g)  # G w GT per (o, c)
    return np.ascontiguousarray(u.reshape(a * a, w.shape[1], w.shape[0]).astype(np.float32))


def conv_float64(x: np.ndarray, u: np.ndarray, m: int, pads: Sequence[int]) -> np.ndarray:
    """The Winograd algorithm itself, in float64, on stored U[a*a, Cin, Cout] (float):
    x[N, Cin, H, W] zero-padded by pads (top, left, bottom, right) -> y[N, Cout, OH, OW],
    each m x m tile AT [sum over c of (BT d_c B) * U_c] A. With U rounded to fp16 or
    bf16 this is what the kernels compute (untransforming U and running the direct conv
    would drop the part of the rounding that no 3x3 filter has)."""
    bt, _, at = matrices(m)
    a = m + 2
    n, c, h, w = x.shape
    pt, pl, pb, pr = (int(p) for p in pads)
    oh, ow = h + pt + pb - 2, w + pl + pr - 2
    th, tw = tiles((oh, ow), m)
    xp = np.zeros((n, c, th * m + 2, tw * m + 2), np.float64)  # overhanging tiles read zeros
    rows, cols = min(h, th * m + 2 - pt), min(w, tw * m + 2 - pl)
    xp[:, :, pt : pt + rows, pl : pl + cols] = x[:, :, :rows, :cols]
    d = np.empty((n, c, th, tw, a, a), np.float64)
    for i in range(a):
        for j in range(a):
            d[..., i, j] = xp[:, :, i : i + th * m : m, j : j + tw * m : m]
    v = np.einsum("ik,nctskl,jl->nctsij", bt, d, bt)
    mm = np.einsum("nctsij,ijco->notsij", v, u.astype(np.float64).reshape(a, a, c, -1))
    y = np.einsum("pi,notsij,qj->notpsq", at, mm, at).reshape(n, -1, th * m, tw * m)
    return y[:, :, :oh, :ow]


def tiles(out_hw: Sequence[int], m: int) -> tuple[int, int]:
    """Tile rows and columns covering an output of out_hw (the last ones overhang)."""
    return -(-int(out_hw[0]) // m), -(-int(out_hw[1]) // m)
