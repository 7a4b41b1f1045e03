"""Benchmark edgepack against ONNX Runtime on the CNN test models, side by side.

Engines, all on the same inputs in one run:

    ort-fp32        ONNX Runtime, the fp32 model
    ort-qdq-int8    ONNX Runtime, static QDQ int8 made by ORT's own quantize_static
                    (per-channel int8 weights, uint8 activations) from the calibration
                    inputs that edgepack's int8 build gets through --calib
    edgepack-fp32   edgepack bundles in each quant mode (fp16, bf16, int8 and int4 store
    edgepack-fp16   only the weights that way; activations stay fp32, see
    edgepack-bf16   docs/quantization.md)
    edgepack-int8
    edgepack-int4
    edgepack-int8x8 int8 weights and u8 activations (--act-quant int8: int8 x int8 convs,
                    calibrated on the same inputs as ORT's QDQ)
    exe-fp32        the device executables for linux-x86_64 (`edgepack build --target`: the
    exe-int8        frozen runtime with its ahead-of-time kernels, what a user ships), each
    exe-int8x8
                    driven through its own `bench --rounds`; the stub is built first
                    (scripts/build_stub.py, minutes) when the stub cache lacks a current one

Every engine of a config runs in its own worker process (so its peak RSS is its own),
loads its model once, and is then asked for small rounds of timed runs in turn, so that
noise from the (shared) machine hits all engines alike.

    python scripts/bench_cnn.py                                   # full matrix, minutes
    python scripts/bench_cnn.py --models digits --batches 1 --threads 1 --runs 20
    python scripts/bench_cnn.py --models resnet18 --batches 1 8 --threads 1 2 --seconds 10
    python scripts/bench_cnn.py --models mobilenet_v2 --batches 1 --threads 2 --busy 1

--busy N keeps N other processes spinning on the CPU while the engines are timed: a
device that also runs a camera pipeline or another service, where one of the engine's
threads loses its core for a scheduler slice now and then.

Models, calibration data and bundles are cached in --work and reused (--rebuild to
redo them). Results go to stdout, --out (markdown) and a PNG chart next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Only stdlib and numpy at module level (and the weight-type table, numpy only): workers
# run this file too, and an ORT worker must not pay (in RSS) for numba/onnx/matplotlib
# that only the parent or edgepack needs. edgepack's package comes before numpy: it
# sets how OpenBLAS's idle threads wait, which OpenBLAS reads as numpy loads it (as
# the edgepack CLI and executables do; nothing else is imported).
import edgepack  # noqa: F401

# isort: split
import numpy as np
from edgepack.kernels.wtypes import QUANT_MODES
from vcpu_probe import FAR_NS, NEAR_NS, SHARED_BELOW, core_share, placement, round_trip_ns

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
DIGITS_ONNX = REPO / "tests" / "data" / "digits_cnn.onnx"

MODELS = ("resnet18", "mobilenet_v2", "digits")
# Build options per bundle kind: every --quant mode of the weight-type table
# (kernels/wtypes.py), and int8 with int8 activations.
BUILDS = {
    **{q: {"quant": q} for q in QUANT_MODES},
    "int8x8": {"quant": "int8", "act_quant": "int8"},
}
QUANTS = tuple(BUILDS)
ORT_FP32, ORT_QDQ = "ort-fp32", "ort-qdq-int8"
EXE_QUANTS, EXE_TARGET = ("fp32", "int8", "int8x8"), "linux-x86_64"
ENGINES = (ORT_FP32, ORT_QDQ) + tuple(f"edgepack-{q}" for q in QUANTS) + tuple(
    f"exe-{q}" for q in EXE_QUANTS
)

CALIB_SAMPLES = 8  # what edgepack's build uses by default, so both int8 paths see the same
CALIB_SEED, INPUT_SEED = 0, 1  # timed inputs differ from the calibration inputs
ROUND_RUNS = 5  # runs per round for the engine with the fewest runs to do
# Idle time between one engine's round and the next's, with more than one thread: the
# worker threads of the engine that just ran keep spinning a while for more work (ORT's
# pool, OpenMP, OpenBLAS) and took the cores from the next engine's first runs
# (MobileNetV2 fp32 at 2 threads: 8.8 ms, P99 46, against 4.8 ms run alone).
ROUND_PAUSE_S = 0.05
MIN_RUNS, MAX_RUNS = 50, 5000  # bounds for the --seconds budget; 50 puts P99 near the max
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimd", "asimddp")
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


# --- shared data --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    model: str
    batch: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.model} b{self.batch} t{self.threads}"


@dataclass
class Assets:
    """Files one (model, batch) needs; shared by every thread count."""

    onnx: Path
    qdq: Path
    bundles: dict[str, Path]
    inputs: Path  # npz keyed by input name: the timed inputs
    exes: dict[str, Path] = field(default_factory=dict)  # quant -> device executable
    notes: list[str] = field(default_factory=list)  # e.g. ORT quantization warnings

    def model_file(self, engine: str) -> Path:
        if engine == ORT_FP32:
            return self.onnx
        if engine == ORT_QDQ:
            return self.qdq
        if engine.startswith("exe-"):
            return self.exes[engine.removeprefix("exe-")]
        return self.bundles[engine.removeprefix("edgepack-")]


@dataclass
class EngineResult:
    engine: str
    times_ms: list[float]
    first_ms: float  # first run after loading: includes numba JIT (or cache load) for edgepack
    import_rss_mb: float  # VmRSS after importing the engine, before loading the model
    peak_rss_mb: float  # VmHWM after loading and all runs
    end_rss_mb: float  # VmRSS after all runs: what stays resident (peak minus transients)
    output: np.ndarray
    extra: dict[str, str] = field(default_factory=dict)
    rel_l2: float = math.nan  # vs ORT fp32 output
    top1: str = ""
    # per run, the vCPU round trip probed just before its round (vcpu_probe.py; NaN at 1
    # thread): on these VMs it decides 2-thread speed
    rt_ns: list[float] = field(default_factory=list)
    # per run, the cores' worth of arithmetic two threads got just before its round
    # (vcpu_probe.core_share; NaN at 1 thread): about 1 when the host ran both vCPUs on
    # one physical core, where no engine's second thread can add compute
    share: list[float] = field(default_factory=list)
    # per run, whether it was its round's first: it follows the other engines' rounds
    # (and at 2 threads the idle pause), so its caches hold their data, not this one's
    round_first: list[bool] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.times_ms))

    @property
    def p99(self) -> float:
        return float(np.percentile(self.times_ms, 99))

    def split_rounds(self) -> tuple[list[float], list[float]]:
        """(each round's first run, the runs after it in their rounds)."""
        first = [t for t, f in zip(self.times_ms, self.round_first) if f]
        return first, [t for t, f in zip(self.times_ms, self.round_first) if not f]

    def where(self, state: str) -> list[float]:
        """The runs timed in rounds whose probe found the vCPUs 'near', 'far' or
        'shared' (vcpu_probe.placement)."""
        return [t for t, rt, sh in zip(self.times_ms, self.rt_ns, self.share)
                if placement(rt, sh) == state]


# --- worker side ----------------------------------------------------------------------------


def _proc_status_mb(key: str, pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0  # reported in kB
    return math.nan


def _load_ort(path: str, threads: int, feeds: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1  # a CNN is a chain; a second pool would only compete
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)[0]


def _load_edgepack(
    path: str, threads: int, feeds: dict[str, np.ndarray]
) -> Callable[[], np.ndarray]:
    from edgepack.runtime.session import Session

    s = Session(path, threads=threads)
    run = s.executor.run_views  # no output copies: ORT's run returns fresh arrays instead
    return lambda: run(feeds)[0]


def _import_engine(engine: str) -> None:
    # Imported before the model is loaded so "import RSS" separates library from model.
    if engine.startswith("ort"):
        import onnxruntime  # noqa: F401
    else:
        import edgepack.runtime.session  # noqa: F401


def _timed_runs(run: Callable[[], np.ndarray], k: int) -> list[float]:
    # gc off while timing (as timeit does) so a collection triggered by one engine's
    # garbage does not land in a random sample.
    times = []
    gc.disable()
    try:
        for _ in range(k):
            t0 = time.perf_counter_ns()
            run()
            times.append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        gc.enable()
    return times


def _engine_extra(engine: str) -> dict[str, str]:
    if engine.startswith("ort"):
        return {}
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = "none"
    return {"numba threading layer": layer}


def worker_main() -> int:
    """Serve one engine: a JSON spec line, then JSON requests, one reply line each."""
    # Replies go over a private copy of stdout; fd 1 is pointed at stderr so that whatever
    # a library prints cannot corrupt the protocol.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**msg: object) -> None:
        proto.write(json.dumps(msg) + "\n")

    spec = json.loads(sys.stdin.readline())
    engine, threads = spec["engine"], int(spec["threads"])
    with np.load(spec["inputs"]) as data:
        feeds = {k: np.ascontiguousarray(data[k]) for k in data.files}
    _import_engine(engine)
    import_rss = _proc_status_mb("VmRSS")
    load = _load_ort if engine.startswith("ort") else _load_edgepack
    t0 = time.perf_counter()
    run = load(spec["path"], threads, feeds)
    reply(ok=True, load_s=time.perf_counter() - t0, import_rss_mb=import_rss)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "run":
            reply(ms=_timed_runs(run, int(req["k"])))
        elif cmd == "output":
            out = np.array(run(), dtype=np.float32)  # a copy: edgepack's is an arena view
            reply(shape=list(out.shape), data=out.ravel().tolist())
        elif cmd == "stats":
            reply(peak_rss_mb=_proc_status_mb("VmHWM"), end_rss_mb=_proc_status_mb("VmRSS"),
                  extra=_engine_extra(engine))
        elif cmd == "exit":
            break
    return 0


# --- parent side: workers -----------------------------------------------------------------


class Worker:
    """One engine in its own process, talking JSON lines over pipes."""

    exit_line = '{"cmd": "exit"}\n'  # then the end of input

    def __init__(self, engine: str, path: Path, inputs: Path, threads: int, log: Path) -> None:
        self.engine, self.log = engine, log
        env = dict(os.environ)
        # Thread counts must be in the environment before numpy/numba/ORT start their pools.
        env.update({k: str(threads) for k in THREAD_ENV})
        log.parent.mkdir(parents=True, exist_ok=True)
        self._err = log.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self._command(path, inputs, threads),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
            text=True, env=env, cwd=REPO,
        )
        self.ready = self._handshake(path, inputs, threads, t0)

    def _command(self, path: Path, inputs: Path, threads: int) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--worker"]

    def _handshake(self, path: Path, inputs: Path, threads: int, t0: float) -> dict:
        spec = {"engine": self.engine, "path": str(path), "inputs": str(inputs),
                "threads": threads}  # fmt: skip
        return self._send(spec)

    def _send(self, msg: dict) -> dict:
        return self._line(json.dumps(msg))

    def _line(self, text: str | None) -> dict:
        """Send one request line (None: only read), return the JSON reply line."""
        assert self.proc.stdin and self.proc.stdout
        try:
            if text is not None:
                self.proc.stdin.write(text + "\n")
                self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died; readline below returns '' and we report its log
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"{self.engine} worker exited ({self.proc.returncode}); "
                               f"log {self.log}:\n{tail}")
        return json.loads(line)

    def request(self, cmd: str, **args: object) -> dict:
        return self._send({"cmd": cmd, **args})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(self.exit_line)  # type: ignore[union-attr]
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class ExeWorker(Worker):
    """A device executable answering rounds through its own ``bench --rounds`` (runtime
    /cli.py), on the same timed inputs; peak and end RSS read from its /proc entry."""

    exit_line = ""  # the end of input ends it

    def _command(self, path: Path, inputs: Path, threads: int) -> list[str]:
        self._out = self.log.with_suffix(".out.npz")
        return [str(path), "bench", "--rounds", "--input", str(inputs), "--threads", str(threads)]

    def _handshake(self, path: Path, inputs: Path, threads: int, t0: float) -> dict:
        self._line(None)  # {"ready": true} once the bundle is mapped and bound
        return {"ok": True, "load_s": time.perf_counter() - t0, "import_rss_mb": math.nan}

    def request(self, cmd: str, **args: object) -> dict:
        if cmd == "run":
            return self._line(f"run {int(args['k'])}")  # type: ignore[call-overload]
        if cmd == "output":
            self._line(f"output {self._out}")
            with np.load(self._out) as data:
                out = np.asarray(data[data.files[0]], np.float32)
            return {"shape": list(out.shape), "data": out.ravel().tolist()}
        if cmd == "stats":
            pid = self.proc.pid
            return {"peak_rss_mb": _proc_status_mb("VmHWM", pid),
                    "end_rss_mb": _proc_status_mb("VmRSS", pid),
                    "extra": {"executable": f"{EXE_TARGET} stub, ahead-of-time kernels"}}
        raise ValueError(cmd)


def _round_sizes(targets: dict[str, int]) -> dict[str, int]:
    """Runs per round for each engine, so that all engines finish in the same round count
    (a fast engine does more runs per round than a slow one) and noise is spread evenly."""
    rounds = max(1, math.ceil(min(targets.values()) / ROUND_RUNS))
    return {e: max(1, math.ceil(n / rounds)) for e, n in targets.items()}


def measure(
    cfg: Config, assets: Assets, engines: Sequence[str], runs: int | None, seconds: float,
    warmup: int, logs: Path,
) -> list[EngineResult]:
    round_trip_ns(10)  # compiled before the first round
    if cfg.threads > 1:
        core_share()
    workers: dict[str, Worker] = {}
    try:
        # Start one at a time so loading does not compete with another worker's loading.
        for e in engines:
            kind = ExeWorker if e.startswith("exe-") else Worker
            workers[e] = kind(e, assets.model_file(e), assets.inputs, cfg.threads,
                              logs / f"{cfg.label.replace(' ', '_')}_{e}.log")
        first, targets = {}, {}
        for e, w in workers.items():
            first[e] = w.request("run", k=1)["ms"][0]  # edgepack: numba JIT or cache load
            warm = w.request("run", k=max(1, warmup - 1))["ms"]
            # Run count from this engine's own speed when no --runs is given.
            est = max(float(np.median(warm)), 1e-3) / 1e3
            targets[e] = runs or int(min(MAX_RUNS, max(MIN_RUNS, seconds / est)))
        chunk = _round_sizes(targets)
        times: dict[str, list[float]] = {e: [] for e in workers}
        rts: dict[str, list[float]] = {e: [] for e in workers}
        shares: dict[str, list[float]] = {e: [] for e in workers}
        firsts: dict[str, list[bool]] = {e: [] for e in workers}
        order = list(workers)
        while any(len(times[e]) < targets[e] for e in order):
            for e in order:
                left = targets[e] - len(times[e])
                if left > 0:
                    rt = round_trip_ns() if cfg.threads > 1 else math.nan
                    sh = core_share() if cfg.threads > 1 else math.nan
                    got = workers[e].request("run", k=min(chunk[e], left))["ms"]
                    times[e] += got
                    rts[e] += [rt] * len(got)
                    shares[e] += [sh] * len(got)
                    firsts[e] += [True] + [False] * (len(got) - 1)
                    if cfg.threads > 1:
                        time.sleep(ROUND_PAUSE_S)
            # Rotate so that no engine always runs right after the same neighbour.
            order = order[1:] + order[:1]
        results = []
        for e, w in workers.items():
            out = w.request("output")
            stats = w.request("stats")
            results.append(EngineResult(
                engine=e, times_ms=times[e], first_ms=first[e],
                import_rss_mb=w.ready["import_rss_mb"], peak_rss_mb=stats["peak_rss_mb"],
                end_rss_mb=stats["end_rss_mb"],
                output=np.asarray(out["data"], np.float32).reshape(out["shape"]),
                extra=stats["extra"], rt_ns=rts[e], share=shares[e], round_first=firsts[e],
            ))
        return results
    finally:
        for w in workers.values():
            w.close()


def compare_outputs(results: list[EngineResult]) -> None:
    """Fill rel_l2 and top-1 agreement against ORT fp32 (a benchmark of wrong answers is
    worthless, so every engine's output is checked on the timed inputs)."""
    ref = next((r.output for r in results if r.engine == ORT_FP32), None)
    if ref is None:
        return
    ref64 = ref.astype(np.float64)
    for r in results:
        got = r.output.astype(np.float64)
        if got.shape != ref.shape:
            r.top1 = f"shape {got.shape}"
            continue
        r.rel_l2 = float(np.linalg.norm(got - ref64) / max(np.linalg.norm(ref64), 1e-30))
        agree = int((got.reshape(len(got), -1).argmax(1) == ref64.reshape(len(ref), -1)
                     .argmax(1)).sum())
        r.top1 = f"{agree}/{len(ref)}"


# --- parent side: assets ------------------------------------------------------------------


def _atomic(path: Path, make: Callable[[Path], None]) -> Path:
    """Make ``path`` through a temporary name so an interrupted run is never reused."""
    tmp = path.with_name(path.stem + ".partial" + path.suffix)
    make(tmp)
    os.replace(tmp, path)
    return path


def _input_name(onnx_path: Path) -> tuple[str, tuple[int, ...]]:
    """Name and per-sample shape (without the batch axis) of the model's one input."""
    import onnx

    inp = onnx.load(str(onnx_path), load_external_data=False).graph.input[0]
    dims = inp.type.tensor_type.shape.dim[1:]
    return inp.name, tuple(d.dim_value for d in dims)


def _samples(model: str, n: int, seed: int, shape: tuple[int, ...], real_from: str) -> np.ndarray:
    """n inputs: real digits images (from the given split) or seeded standard normal, which
    is what the random-weight models' activations were scaled for (see make_models.py)."""
    if model == "digits":
        sys.path.insert(0, str(SCRIPTS))
        from train_digits import load_split

        x_train, x_test, _, _ = load_split()
        pool = x_train if real_from == "train" else x_test
        idx = np.random.default_rng(seed).choice(len(pool), size=n, replace=False)
        return np.ascontiguousarray(pool[np.sort(idx)], dtype=np.float32)
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


def _model_onnx(model: str, batch: int, work: Path, rebuild: bool) -> Path:
    if model == "digits":
        return DIGITS_ONNX  # symbolic batch already; edgepack fixes it through input_shapes
    path = work / f"{model}_b{batch}.onnx"
    if rebuild or not path.exists():
        import onnx

        sys.path.insert(0, str(SCRIPTS))
        import make_models

        proto = getattr(make_models, model)(seed=0, batch=batch)
        _atomic(path, lambda p: onnx.save(proto, str(p)))
    return path


def calib_batches(samples: np.ndarray, batch: int) -> list[np.ndarray]:
    """Group samples into feeds of ``batch`` the way edgepack's load_calibration does
    (the last group wraps around), so ORT calibrates on exactly the same feeds."""
    groups = -(-len(samples) // batch)
    idx = np.arange(groups * batch) % len(samples)
    return list(samples[idx].reshape((groups, batch) + samples.shape[1:]))


def _quantize_qdq(src: Path, dst: Path, name: str, feeds: list[np.ndarray]) -> list[str]:
    """ORT static QDQ int8; returns the warnings ORT emitted (worth reporting)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter({name: f} for f in feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    caught: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            # Pre-processing folds BatchNormalization into Conv and infers shapes; without
            # it ORT leaves BN in fp32 between QDQ pairs and warns.
            pre = dst.with_name(dst.stem + ".pre.onnx")
            quant_pre_process(str(src), str(pre))
            quantize_static(
                str(pre), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
            )
            pre.unlink()
        caught += [str(w.message) for w in ws]
    finally:
        logging.getLogger().removeHandler(handler)
    return list(dict.fromkeys(m.strip() for m in caught if m.strip()))


def current_stub() -> Path:
    """The stub cache's linux-x86_64 stub, built first (scripts/build_stub.py, minutes)
    when it is missing or older than this checkout's runtime."""
    from edgepack.packager.build import PackError
    from edgepack.packager.stub import cached_stub, check_stub
    from edgepack.targets import load_target

    target = load_target(EXE_TARGET)
    try:
        check_stub(cached_stub(target), target)
    except (PackError, OSError) as e:
        print(f"  building the {EXE_TARGET} stub ({e})", flush=True)
        subprocess.run([sys.executable, str(SCRIPTS / "build_stub.py"), "--target", EXE_TARGET],
                       check=True, cwd=REPO)
        check_stub(cached_stub(target), target)
    return cached_stub(target)


def prepare(
    model: str, batch: int, work: Path, rebuild: bool, exe_quants: Sequence[str] = ()
) -> Assets:
    """Model, calibration npz, timed inputs, ORT QDQ model, the bundles, and the device
    executables of ``exe_quants``."""
    from edgepack.packager.build import build

    onnx_path = _model_onnx(model, batch, work, rebuild)
    name, shape = _input_name(onnx_path)
    stem = f"{model}_b{batch}"
    calib = work / f"calib_{model}.npz"
    if rebuild or not calib.exists():
        x = _samples(model, CALIB_SAMPLES, CALIB_SEED, shape, real_from="train")
        _atomic(calib, lambda p: np.savez(p, **{name: x}))
    inputs = work / f"inputs_{stem}.npz"
    if rebuild or not inputs.exists():
        x = _samples(model, batch, INPUT_SEED, shape, real_from="test")
        _atomic(inputs, lambda p: np.savez(p, **{name: x}))

    qdq = work / f"{stem}.qdq.onnx"
    qlog = qdq.with_suffix(".log")
    if rebuild or not qdq.exists():
        print(f"  quantizing {qdq.name} with onnxruntime.quantization", flush=True)
        with np.load(calib) as data:
            feeds = calib_batches(data[name], batch)
        msgs: list[str] = []
        _atomic(qdq, lambda p: msgs.extend(_quantize_qdq(onnx_path, p, name, feeds)))
        qlog.write_text("".join(m + "\n" for m in msgs))
        for m in msgs:
            print(f"    ORT: {m}", flush=True)
    notes = [f"ORT quantize_static: {m}" for m in qlog.read_text().splitlines()] \
        if qlog.exists() else []

    bundles = {}
    for q in QUANTS:
        epk = work / f"{stem}.{q}.epk"
        if rebuild or not epk.exists():
            print(f"  building {epk.name} (log {epk.with_suffix('.log').name})", flush=True)
            with epk.with_suffix(".log").open("w") as f:
                _atomic(epk, lambda p, q=q, f=f: build(
                    onnx_path, p, **BUILDS[q], input_shapes={name: (batch, *shape)},
                    calib=calib if q != "fp32" else None, log=lambda s: print(s, file=f),
                ))
        bundles[q] = epk
    exes = {}
    if exe_quants:
        from edgepack.packager.target_build import build_for_target
        from edgepack.targets import load_target

        stub = current_stub()
        for q in exe_quants:
            exe = work / f"{stem}.{q}-{EXE_TARGET}"
            if rebuild or not exe.exists() or exe.stat().st_mtime < stub.stat().st_mtime:
                print(f"  building {exe.name} (log {exe.name}.log)", flush=True)
                with Path(f"{exe}.log").open("w") as f:
                    build_for_target(
                        onnx_path, load_target(EXE_TARGET), exe, **BUILDS[q],
                        input_shapes={name: (batch, *shape)},
                        calib=calib if q != "fp32" else None, log=lambda s: print(s, file=f),
                    )  # fmt: skip
            exes[q] = exe
    return Assets(onnx=onnx_path, qdq=qdq, bundles=bundles, inputs=inputs, notes=notes,
                  exes=exes)


# --- reporting ------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    import numba
    import onnx
    import onnxruntime

    from edgepack import __version__ as ep_version

    cpu, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "unknown":
            cpu = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    # The SIMD extensions decide int8 speed: ORT's QDQ kernels use VNNI when present.
    isa = [f for f in ISA_FLAGS if f in flags]
    return {
        "CPU": cpu,
        "cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable",
        "SIMD": ", ".join(isa) or "none of " + ", ".join(ISA_FLAGS),
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "Python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "edgepack": ep_version,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _ratio(r: EngineResult, ref: EngineResult | None) -> str:
    if ref is None or not r.engine.startswith(("edgepack", "exe")):
        return ""
    return f"{r.median / ref.median:.2f}"


COLUMNS = ("engine", "runs", "median ms", "P99 ms", "/ORT fp32", "/ORT QDQ", "peak RSS MB",
           "end RSS MB", "import RSS MB", "1st run ms", "rel L2", "top-1")


def table_rows(results: list[EngineResult]) -> list[list[str]]:
    by = {r.engine: r for r in results}
    rows = []
    for r in results:
        rows.append([
            r.engine, str(len(r.times_ms)), f"{r.median:.3f}", f"{r.p99:.3f}",
            _ratio(r, by.get(ORT_FP32)), _ratio(r, by.get(ORT_QDQ)),
            f"{r.peak_rss_mb:.0f}", f"{r.end_rss_mb:.0f}", f"{r.import_rss_mb:.0f}",
            f"{r.first_ms:.1f}",
            "" if math.isnan(r.rel_l2) else f"{r.rel_l2:.1e}", r.top1,
        ])
    return rows


def format_text(title: str, results: list[EngineResult]) -> str:
    rows = [list(COLUMNS)] + table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [title]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def format_markdown(
    results: dict[Config, list[EngineResult]], info: dict[str, str], notes: list[str],
    chart: Path, argv: list[str],
) -> str:
    md = ["# edgepack vs ONNX Runtime: CNN latency and memory", "",
          "Generated by `scripts/bench_cnn.py`. Lower is better everywhere; a ratio above 1 "
          "means edgepack is slower than that ORT engine.", "", "## Machine", ""]
    md += [f"- {k}: {v}" for k, v in info.items()]
    md += ["", "## Method", "",
           "- Engines: ORT fp32; ORT static QDQ int8 (`quant_pre_process`, then "
           "`quantize_static`, QDQ, per-channel QInt8 weights, QUInt8 activations, MinMax); "
           f"edgepack bundles built with `--quant {'|'.join(QUANT_MODES)}`, and `int8x8`: "
           "`--quant int8 --act-quant int8`. edgepack's quantized modes are weight-only "
           "(activations stay fp32) but for int8x8, whose convs compute in int8 as ORT "
           "QDQ does.",
           f"- Calibration: one npz of {CALIB_SAMPLES} inputs (seeded standard normal for the "
           "random-weight models, real training images for digits), given to edgepack's "
           "int8 build as `--calib` (where it only measures the error) and to ORT's "
           "quantize_static grouped into the same feeds.",
           "- Timed inputs: one other seeded batch (digits: test images), the same for all.",
           "- Each engine runs in its own process with its thread count set before import "
           "(`OMP/OPENBLAS/MKL/NUMBA_NUM_THREADS`; ORT `intra_op_num_threads=N`, "
           "`inter_op_num_threads=1`; edgepack `Session(threads=N)`). Peak RSS is `VmHWM` "
           "after loading and all runs; end RSS is `VmRSS` then (peak minus transients such as "
           "numba/LLVM start-up); import RSS is `VmRSS` after importing the engine, before "
           "loading the model.",
           "- Warm-up runs first (the 1st-run column: for edgepack it includes numba's JIT "
           "compile or cache load), then rounds of runs alternate between the engines, "
           "rotating the order, until each has its run count; with more than one "
           f"thread, {ROUND_PAUSE_S * 1e3:.0f} ms pass idle between rounds, so that one "
           "engine's spinning pool threads do not take the cores from the next one's "
           "runs. gc is off while timing. "
           "edgepack runs through `executor.run_views` (no output copies).",
           f"- exe-*: the device executable for {EXE_TARGET} (`edgepack build --target "
           f"{EXE_TARGET}`: the frozen runtime and its ahead-of-time kernels, what a user "
           "ships), answering the same rounds through its own `bench --rounds` on the same "
           "inputs; its RSS columns are read from its /proc entry (no import RSS).",
           "- rel L2 and top-1: each engine's output on the timed inputs vs ORT fp32.",
           "", "## Results", "", f"![median latency per config]({chart.name})", ""]
    md += _summary_markdown(results)
    md += _placement_markdown(results)
    md += _rounds_markdown(results)
    for cfg, res in results.items():
        threads = "1 thread" if cfg.threads == 1 else f"{cfg.threads} threads"
        md += [f"### {cfg.model}, batch {cfg.batch}, {threads}", ""]
        md += _md_table(list(COLUMNS), table_rows(res)) + [""]
        extras = {f"{k}: {v}" for r in res for k, v in r.extra.items()}
        if extras:
            md += ["- " + "; ".join(sorted(extras)), ""]
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    md += ["## Reproduce", "", "```", "pip install -e '.[dev]' matplotlib",
           "python scripts/bench_cnn.py " + " ".join(argv), "```", ""]
    return "\n".join(md)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def placement_rows(results: dict[Config, list[EngineResult]]) -> list[list[str]]:
    """Per multi-thread config and engine: median, P99 and speed-up over the same engine's
    1-thread median, in the rounds whose probe found the vCPUs near (one core complex),
    far apart, or sharing one core's arithmetic (vcpu_probe.py), with the runs each
    had."""
    ones = {(c.model, c.batch, r.engine): r.median
            for c, res in results.items() if c.threads == 1 for r in res}
    rows = []
    for cfg, res in results.items():
        if cfg.threads == 1:
            continue
        for r in res:
            row = [cfg.label, r.engine]
            for state in PLACEMENTS:
                ts = r.where(state)
                if not ts:
                    row += ["0", "", "", ""]
                    continue
                med = float(np.median(ts))
                one = ones.get((cfg.model, cfg.batch, r.engine))
                row += [str(len(ts)), f"{med:.3f}", f"{np.percentile(ts, 99):.3f}",
                        f"{one / med:.2f}" if one else ""]
            rows.append(row)
    return rows


PLACEMENTS = ("near", "far", "shared")
PLACEMENT_COLUMNS = ("config", "engine") + tuple(
    f"{p} {c}" for p in PLACEMENTS for c in ("runs", "median", "P99", "speed-up"))


def round_rows(results: dict[Config, list[EngineResult]]) -> list[list[str]]:
    """Per config and engine: the median and P90 of each round's first run (one run in
    ROUND_RUNS or so, after the other engines' rounds), and the median, P99 and their
    ratio of the runs after it: whether a P99 over all runs is the cold first runs."""
    rows = []
    for cfg, res in results.items():
        for r in res:
            first, rest = r.split_rounds()
            if not first or not rest:
                continue
            rows.append([cfg.label, r.engine, str(len(first)), f"{np.median(first):.3f}",
                         f"{np.percentile(first, 90):.3f}", str(len(rest)),
                         f"{np.median(rest):.3f}", f"{np.percentile(rest, 99):.3f}",
                         f"{np.percentile(rest, 99) / np.median(rest):.2f}"])  # fmt: skip
    return rows


ROUND_COLUMNS = ("config", "engine", "round-first runs", "median", "P90", "other runs",
                 "median", "P99", "P99/median")  # fmt: skip


def _section(title: str, intro: str, columns: Sequence[str], rows: list[list[str]]) -> list[str]:
    """A report section: heading, one paragraph, the table (nothing without rows)."""
    if not rows:
        return []
    return [f"### {title}", "", intro, ""] + _md_table(list(columns), rows) + [""]


def _rounds_markdown(results: dict[Config, list[EngineResult]]) -> list[str]:
    return _section(
        "Each round's first run against the rest",
        "A round's first run comes after the other engines' rounds (and, with more than "
        "one thread, the idle pause): the caches hold their data, and idle cores may "
        "have gone to sleep. The other runs follow a run of the same engine.",
        ROUND_COLUMNS, round_rows(results),
    )


def _placement_markdown(results: dict[Config, list[EngineResult]]) -> list[str]:
    return _section(
        "Multi-thread rounds by where the host put the vCPUs",
        "Before each round the parent times a cache line's round trip between two pinned "
        f"threads (scripts/vcpu_probe.py): under {NEAR_NS:.0f} ns the two vCPUs share a "
        f"core complex (near), over {FAR_NS:.0f} ns they do not (far), and the state "
        "lasts seconds to minutes. It also times a register-only multiply-add loop on "
        "both vCPUs at once against one: under "
        f"{SHARED_BELOW:.1f} cores' worth the host ran both on one physical core "
        "(shared), where a second thread adds no arithmetic to any engine. Speed-up: "
        "the same engine's 1-thread median over this median.",
        PLACEMENT_COLUMNS, placement_rows(results),
    )


def _summary_markdown(results: dict[Config, list[EngineResult]]) -> list[str]:
    engines = [e for e in ENGINES if any(r.engine == e for res in results.values() for r in res)]
    rows = []
    for cfg, res in results.items():
        by = {r.engine: r for r in res}
        rows.append([cfg.label] + [f"{by[e].median:.2f}" if e in by else "" for e in engines])
    return ["Median latency (ms):", ""] + _md_table(["config"] + engines, rows) + [""]


def plot(results: dict[Config, list[EngineResult]], path: Path) -> None:
    """Grouped bars of median latency (whisker up to P99), one panel per model, since the
    models differ by orders of magnitude."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a bench machine
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c.model for c in results))
    engines = [e for e in ENGINES if any(r.engine == e for res in results.values() for r in res)]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    width = 0.8 / max(1, len(engines))
    for ax, model in zip(axes[0], models):
        cfgs = [c for c in results if c.model == model]
        for i, e in enumerate(engines):
            xs, med, p99 = [], [], []
            for j, c in enumerate(cfgs):
                r = next((r for r in results[c] if r.engine == e), None)
                if r is not None:
                    xs.append(j + (i - (len(engines) - 1) / 2) * width)
                    med.append(r.median)
                    p99.append(r.p99 - r.median)
            ax.bar(xs, med, width, label=e, yerr=[[0] * len(p99), p99], capsize=2,
                   error_kw={"elinewidth": 0.8})
        ax.set_xticks(range(len(cfgs)), [f"b{c.batch} t{c.threads}" for c in cfgs])
        ax.set_title(model)
        ax.set_ylabel("median ms (whisker: P99)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    results: dict[Config, list[EngineResult]], info: dict[str, str], notes: list[str],
    out: Path, argv: list[str],
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    chart = out.with_suffix(".png")
    plot(results, chart)
    out.write_text(format_markdown(results, info, notes, chart, argv))


# --- main ------------------------------------------------------------------------------------


def _split(values: list[str]) -> list[str]:
    """Accept both `--models a b` and `--models a,b`."""
    return [v for arg in values for v in arg.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="M",
                   help=f"from {', '.join(MODELS)}")
    p.add_argument("--batches", nargs="+", default=["1", "8"], metavar="B")
    p.add_argument("--threads", nargs="+", default=["1", "2"], metavar="N")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), metavar="E",
                   help=f"from {', '.join(ENGINES)}")
    p.add_argument("--runs", type=int, default=None,
                   help="timed runs per engine per config (default: from --seconds)")
    p.add_argument("--seconds", type=float, default=5.0,
                   help=f"time budget per engine per config when --runs is not given "
                        f"(runs clamped to {MIN_RUNS}..{MAX_RUNS})")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per engine first")
    p.add_argument("--work", type=Path, default=Path("/tmp/edgepack-bench"),
                   help="cache for models, calibration data, bundles and worker logs")
    p.add_argument("--rebuild", action="store_true",
                   help="redo everything in --work (after changing edgepack or the models)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "cnn.md")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="other processes spinning on the CPU while timing (a loaded device)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = _split(args.models)
    args.engines = _split(args.engines)
    args.batches = [int(b) for b in _split(args.batches)]
    args.threads = [int(t) for t in _split(args.threads)]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    if args.runs is not None and args.runs < 1:
        p.error("--runs must be >= 1")
    if args.busy < 0:
        p.error("--busy must be >= 0")
    return args


@contextlib.contextmanager
def busy_processes(n: int):
    """n child processes that spin in Python at the default priority until the block ends
    (another program on the device, as the scheduler sees it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for pr in procs:
            pr.kill()
        for pr in procs:
            pr.wait()


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.worker:
        return worker_main()
    if max(args.threads) > len(os.sched_getaffinity(0)):
        print(f"warning: {max(args.threads)} threads > {len(os.sched_getaffinity(0))} usable "
              "cores; timings will be oversubscribed", file=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    if args.busy:
        info["load"] = f"{args.busy} other process(es) spinning on the CPU while timing (--busy)"
    print("  ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    results: dict[Config, list[EngineResult]] = {}
    notes: list[str] = []
    for model in args.models:
        for batch in args.batches:
            print(f"== {model} batch {batch}: preparing in {args.work}", flush=True)
            exe_quants = [e.removeprefix("exe-") for e in args.engines if e.startswith("exe-")]
            assets = prepare(model, batch, args.work, args.rebuild, exe_quants)
            notes += [f"{model} b{batch}: {n}" for n in assets.notes]
            for threads in args.threads:
                cfg = Config(model, batch, threads)
                t0 = time.perf_counter()
                with busy_processes(args.busy):
                    res = measure(cfg, assets, args.engines, args.runs, args.seconds,
                                  args.warmup, args.work / "logs")
                compare_outputs(res)
                results[cfg] = res
                print(format_text(f"-- {cfg.label} ({time.perf_counter() - t0:.0f}s)", res),
                      flush=True)
                for row in placement_rows(results):
                    if row[0] == cfg.label:
                        print("   " + "  ".join(f"{k}={v}" for k, v in
                                                zip(PLACEMENT_COLUMNS[1:], row[1:])))
                for row in round_rows(results):
                    if row[0] == cfg.label:
                        print("   " + "  ".join(row[1:]))
                # Rewritten after every config so an interrupted long run keeps its results.
                write_report(results, info, notes, args.out, raw)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
