"""Should int8 bundles quantize activations too? Measure the choice on this CPU.

For conv layers shaped like ResNet-18's, times on one thread, side by side:
  fp32-act  : what the runtime does: widen int8 weights to fp32 scratch, BLAS sgemm
              (np.matmul into a preallocated output), per-channel scale in the epilogue;
  int8-act  : dynamic activation quantization: quantize the im2col columns to int8
              (per tensor), int8 x int8 -> int32 GEMM in numba, rescale to fp32.
Prints median and P99 per layer and the ratio. Usage: python scripts/bench_int8_activations.py
"""

from __future__ import annotations

import time

import numba
import numpy as np
from edgepack.kernels.cpu import kernels as K
from edgepack.packager.quantize import quantize_int8
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def quantize_cols(x, q):
    """Per-tensor symmetric int8 of x (flat); returns the scale."""
    amax = np.float32(0)
    for i in range(x.size):
        v = abs(x[i])
        if v > amax:
            amax = v
    s = amax / np.float32(127) if amax > 0 else np.float32(1)
    inv = np.float32(1) / s
    for i in prange(x.size):
        q[i] = np.int8(min(max(round(x[i] * inv), -127), 127))
    return s


@njit(parallel=True, fastmath=True, cache=True)
def gemm_s8(w, xq, y, wscale, xscale):
    """y[M,N] = (w[M,K] int8 @ xq[K,N] int8) * wscale[m] * xscale, int32 accumulators."""
    m_, k_ = w.shape
    n_ = xq.shape[1]
    for m in prange(m_):
        acc = np.zeros(n_, np.int32)
        for k in range(k_):
            wv = np.int32(w[m, k])
            for n in range(n_):
                acc[n] += wv * np.int32(xq[k, n])
        s = wscale[m] * xscale
        for n in range(n_):
            y[m, n] = np.float32(acc[n]) * s


def timeit(fn, runs: int = 30) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts)), float(np.percentile(ts, 99))


def main() -> None:
    numba.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, "blas")
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    layers = [
        ("layer1 3x3", 64, 576, 3136),
        ("layer2 3x3", 128, 1152, 784),
        ("layer3 3x3", 256, 2304, 196),
        ("layer4 3x3", 512, 4608, 49),
    ]
    print("median (P99) ms, 1 thread")
    print(f"{'layer':<12} {'M x K x N':>18} {'fp32-act':>16} {'int8-act':>16} {'ratio':>7}")
    for name, m, k, n in layers:
        w = rng.standard_normal((m, k)).astype(np.float32)
        wq, ws = quantize_int8(w)
        cols = rng.standard_normal((k, n)).astype(np.float32)
        wf = np.empty((m, k), np.float32)
        y = np.empty((m, n), np.float32)
        xq = np.empty((k, n), np.int8)
        d1 = np.zeros(1, np.float32)
        d2 = np.zeros((1, 1), np.float32)

        def fp32_path(wq=wq, wf=wf, cols=cols, y=y, ws=ws, d1=d1, d2=d2):
            K.decode_i8(wq.reshape(-1), wf.reshape(-1))
            np.matmul(wf, cols, out=y)
            K.epilogue_rows(y, d1, ws, d2, 2, 0, np.float32(0), np.float32(0))

        def int8_path(wq=wq, cols=cols, xq=xq, y=y, ws=ws):
            s = quantize_cols(cols.reshape(-1), xq.reshape(-1))
            gemm_s8(wq, xq, y, ws, np.float32(s))

        a, a99 = timeit(fp32_path)
        b, b99 = timeit(int8_path)
        print(
            f"{name:<12} {f'{m}x{k}x{n}':>18} {a:>7.2f} ({a99:.2f}) {b:>7.2f} ({b99:.2f}) "
            f"{b / a:>6.2f}x"
        )


if __name__ == "__main__":
    main()
