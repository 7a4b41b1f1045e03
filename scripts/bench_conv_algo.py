"""Direct (im2col + GEMM) vs Winograd F(2x2,3x3) vs F(4x4,3x3) per conv layer shape.

The measurement behind packager/conv_algo.py's rule. Each algorithm runs through the
CPU backend's real bind path (planned scratch, fused bias + ReLU epilogue) on the
3x3 stride-1 layer shapes of ResNet-18 and a few channel counts; the algorithms of a
shape take turns in rounds so machine noise hits them alike.

    python scripts/bench_conv_algo.py                 # 1 thread
    python scripts/bench_conv_algo.py --threads 2 --rounds 40
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# (Cin = Cout, output side): ResNet-18's stages, plus narrow layers near the cut-off.
SHAPES = [(64, 56), (128, 28), (256, 14), (512, 7), (16, 56), (32, 28), (16, 14), (64, 7)]


def bind(algo: str, c: int, side: int, rng: np.random.Generator):
    from edgepack.kernels import winograd
    from edgepack.kernels.registry import lookup
    from edgepack.runtime.executor import aligned_arena

    x = rng.standard_normal((1, c, side, side)).astype(np.float32)
    w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    y = np.empty((1, c, side, side), np.float32)
    attrs = {
        "strides": [1, 1],
        "pads": [1, 1, 1, 1],
        "dilations": [1, 1],
        "group": 1,
        "act": "relu",
        "act_args": [0.0, 0.0],
    }
    if algo == "direct":
        op, wt = "conv", w
    else:
        op, wt = "conv_wino", winograd.transform_weights(w, int(algo[1]))
        attrs["tile"] = int(algo[1])
    k = lookup(op, "f32", "cpu")
    specs = [(x.shape, "f32"), (wt.shape, "f32"), (b.shape, "f32")]
    scratch = aligned_arena(max(k.scratch(specs, [y.shape], attrs), 1))  # as the runtime does
    wt.flags.writeable = False
    return k.bind([x, wt, b], [y], scratch, attrs), y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    a = ap.parse_args()
    from edgepack.runtime.threads import set_threads

    set_threads(a.threads)
    rng = np.random.default_rng(0)
    algos = ("direct", "F2", "F4")
    print(f"{a.threads} thread(s), {a.rounds} rounds; ms median (min); x = speed-up over direct")
    print(f"{'C':>5} {'out':>5} " + " ".join(f"{n:>20}" for n in algos))
    for c, side in SHAPES:
        seed = int(rng.integers(1 << 31))  # the same layer (inputs, weights) for every algorithm
        steps = {n: bind(n, c, side, np.random.default_rng(seed)) for n in algos}
        ref = None
        for n, (step, y) in steps.items():  # warm-up, and the algorithms must agree
            step()
            if ref is None:
                ref = y.copy()
            else:
                err = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
                assert err < 1e-4, f"{n} disagrees with direct on C={c} side={side}: {err:.2e}"
        times: dict[str, list[float]] = {n: [] for n in algos}
        for _ in range(a.rounds):
            for n, (step, _) in steps.items():
                t = time.perf_counter()
                step()
                times[n].append(time.perf_counter() - t)
        med = {n: float(np.median(v)) * 1e3 for n, v in times.items()}
        cells = [
            f"{med[n]:7.3f} ({min(times[n]) * 1e3:6.3f}) x{med['direct'] / med[n]:4.2f}"
            for n in algos
        ]
        print(f"{c:>5} {side:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
