"""Channels-last depthwise conv (cpu_nhwc.dwconv_nhwc) against the planar kernels.

MobileNetV2's 3x3 depthwise layers with their bias + ReLU6 epilogue, one image. The
planar side runs the kernel backend_cpu._dw_planes picks for the shape (dwconv3_flat,
dwconv3_s2 or the row-wise dwconv) on its per-slot planes; both kernels get the same
data (transposed) and must agree. The two take turns in rounds so machine noise hits
them alike; each round times one call, after reading its input once (untimed) as the
layer before would have written it, unless ``--cold``. ONNX Runtime's per-node times
(1 thread, this machine, from its profiler, a quiet hour) are listed for reference;
``--ort`` also runs ONNX Runtime on a one-layer model (Conv + Clip) in the same
rounds and reports the node times of its own profile (no Python call overhead).
On a shared machine the ratios within a run mean more than the absolute times.

    python scripts/bench_nhwc_dw.py                  # 1 thread, 200 rounds
    python scripts/bench_nhwc_dw.py --rounds 500 --int8 --ort
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

# (channels, input side, stride, ONNX Runtime ms: 1 thread, Conv + bias + ReLU6)
SHAPES = [
    (32, 112, 1, 0.50),
    (96, 112, 2, 0.59),
    (144, 56, 1, 0.44),
    (144, 56, 2, 0.16),
    (192, 28, 1, 0.14),
    (384, 14, 1, 0.087),
    (576, 14, 1, 0.127),
    (576, 14, 2, 0.047),
    (960, 7, 1, 0.065),
]


def _planar_choice(c: int, oh: int, ow: int, s: int):
    """(kernel name, planes shape or None), as the CPU backend binds the layer."""
    from edgepack.kernels.cpu import backend as backend_cpu

    attrs = {"strides": [s, s], "pads": [1, 1, 1, 1], "dilations": [1, 1]}
    return backend_cpu._dw_planes((c, 1, 3, 3), (1, c, oh, ow), attrs) or ("dwconv", None)


def make_layer(c: int, side: int, s: int, int8: bool, rng: np.random.Generator):
    """(planar step, nhwc step, planar out, nhwc out, planar kernel name, planar input,
    nhwc input)."""
    from edgepack.kernels.cpu import kernels as K
    from edgepack.kernels.cpu import nhwc as N
    from edgepack.kernels.flags import HAS_BIAS, HAS_SCALE

    oh = ow = (side + 2 - 3) // s + 1
    x = rng.standard_normal((c, side, side)).astype(np.float32)
    w = (rng.standard_normal((c, 1, 3, 3)) / 3).astype(np.float32)
    bias = (rng.standard_normal(c) * 0.5).astype(np.float32)
    scale = np.ones(c, np.float32)
    flags = HAS_BIAS
    if int8:
        amax = np.abs(w).reshape(c, -1).max(axis=1)
        scale = (np.where(amax > 0, amax, 1) / 127).astype(np.float32)
        w = np.clip(np.round(w / scale[:, None, None, None]), -127, 127).astype(np.int8)
        flags = HAS_BIAS | HAS_SCALE
    xt = np.ascontiguousarray(x.transpose(1, 2, 0))
    wt = np.ascontiguousarray(w.transpose(2, 3, 1, 0))  # [kh, kw, 1, C]
    for a in (w, wt, bias, scale):
        a.flags.writeable = False  # weights are read-only maps in a bundle
    y = np.empty((c, oh, ow), np.float32)
    yt = np.empty((oh, ow, c), np.float32)
    dummy = np.zeros((1, 1, 1), np.float32)
    lo, hi = np.float32(0), np.float32(6)
    name, pshape = _planar_choice(c, oh, ow, s)
    if pshape is not None:
        planes = np.empty(pshape, np.float32)
        kern = getattr(K, name)

        def planar() -> None:
            kern(x, w, bias, scale, dummy, y, planes, flags, 3, lo, hi)

    else:

        def planar() -> None:
            K.dwconv(x, w, bias, scale, dummy, y, s, s, 1, 1, 1, 1, flags, 3, lo, hi)

    def nhwc() -> None:
        N.dwconv_nhwc(xt, wt, bias, scale, dummy, yt, s, s, 1, 1, 1, 1, flags, 3, lo, hi)

    return planar, nhwc, y, yt, name, x, xt


def ort_layer(c: int, side: int, s: int, rng: np.random.Generator):
    """(step, times, input) for ONNX Runtime on a one-layer model (Conv + Clip), 1
    thread: ``times()`` reads its profile after the runs and returns each run's node
    kernel time in ms, so Python's call overhead is not counted."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((c, 1, 3, 3)) / 3).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(np.array(0, np.float32), "lo"),
        numpy_helper.from_array(np.array(6, np.float32), "hi"),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["t"],
            group=c,
            kernel_shape=[3, 3],
            strides=[s, s],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Clip", ["t", "lo", "hi"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feed = {"x": rng.standard_normal((1, c, side, side)).astype(np.float32)}

    def step() -> None:
        sess.run(None, feed)

    def times() -> list[float]:
        with open(sess.end_profiling()) as f:
            events = json.load(f)
        runs: list[float] = []
        for e in events:
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                runs.append(0.0)
            elif runs and e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                runs[-1] += e["dur"] / 1e3
        return runs

    return step, times, feed["x"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--int8", action="store_true", help="int8 weights with a per-channel scale")
    ap.add_argument("--ort", action="store_true", help="also measure ONNX Runtime in this run")
    ap.add_argument(
        "--cold", action="store_true", help="do not read each input into cache before its call"
    )
    a = ap.parse_args()
    import numba

    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)
    wdt = "int8" if a.int8 else "fp32"
    print(
        f"{numba.get_num_threads()} thread(s), {a.rounds} rounds, {wdt} weights, bias + ReLU6; "
        "ms per call, median / P99"
    )
    head = f"{'C':>4} {'in':>4} {'s':>2}  {'planar kernel':<13} {'planar':>15} {'nhwc':>15}"
    head += f" {'x planar':>8} {'ORT':>6}" + (f" {'ORT now':>15}" if a.ort else "")
    print(head)
    for c, side, s, ort_ms in SHAPES:
        planar, nhwc, y, yt, name, x, xt = make_layer(c, side, s, a.int8, rng)
        planar()
        nhwc()
        err = np.abs(y.transpose(1, 2, 0) - yt).max() / max(float(np.abs(y).max()), 1e-30)
        assert err < 1e-5, f"C={c} side={side} s={s}: nhwc and planar disagree ({err:.2e})"
        steps = [("planar", planar, x), ("nhwc", nhwc, xt)]
        if a.ort:
            ort_step, ort_times, ort_x = ort_layer(c, side, s, rng)
            ort_step()  # warm-up (its profile entry is dropped below)
            steps.append(("ort", ort_step, ort_x))
        times: dict[str, list[float]] = {k: [] for k, _, _ in steps}
        for _ in range(a.rounds):
            for key, step, inp in steps:
                if not a.cold:
                    inp.sum()  # in a network the layer before has just written it
                t = time.perf_counter()
                step()
                times[key].append(time.perf_counter() - t)
        if a.ort:
            times["ort"] = [t / 1e3 for t in ort_times()[1:]]
        med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        p99 = {k: float(np.percentile(v, 99)) * 1e3 for k, v in times.items()}
        row = f"{c:>4} {side:>4} {s:>2}  {name:<13}"
        for k in ("planar", "nhwc"):
            row += f" {med[k]:>7.3f} /{p99[k]:>6.3f}"
        row += f" {med['planar'] / med['nhwc']:>7.2f}x {ort_ms:>6.3f}"
        if a.ort:
            row += f" {med['ort']:>7.3f} /{p99['ort']:>6.3f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
