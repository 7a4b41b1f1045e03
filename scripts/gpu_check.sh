#!/usr/bin/env bash
# Check the cuda backend on a real NVIDIA GPU (the CPU-only CI runs the same tests in
# numba's CUDA simulator). Needs: an NVIDIA driver, edgepack installed with its dev
# extra, cupy for the machine's CUDA (pip install cupy-cuda12x) and libNVVM for numba.cuda
# (a CUDA toolkit with CUDA_HOME set, or pip install "numba-cuda[cu12]").
#
#   scripts/gpu_check.sh              # from the repository root or anywhere
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# Steps: (1) preflight: the GPU, cupy and numba.cuda can compile and run a kernel;
# (2) the `cuda` test group with the simulator OFF (every cuda kernel against the NumPy
# reference, the end-to-end digits bundle, selection/fallback); (3) digits and
# ResNet-18 bundles packed for cuda, run on the GPU and on the cpu fallback: max error
# between them and median latencies. Exit status is non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export NUMBA_ENABLE_CUDASIM=0  # conftest.py turns the simulator on unless this is set
unset EDGEPACK_NO_GPU || true

echo "== 1/3 preflight"
"$PY" - <<'EOF'
import sys

import numpy as np

from edgepack.kernels.cuda_dev import dev, probe

ok, why = probe()
print(f"GPU: {why}")
if not ok:
    sys.exit("gpu_check: no usable GPU; see the message above")
import cupy

d = dev()
assert not d.simulated and d.xp is cupy, "simulator still on: NUMBA_ENABLE_CUDASIM leaked?"
from edgepack.kernels import cuda_kernels as K

src = d.upload(np.arange(-128, 128, dtype=np.int8))
out = d.xp.zeros(256, d.xp.float32)
d.launch(K.decode_i8, 256)(d.arg(src), d.arg(out))
assert (out.get() == np.arange(-128, 128)).all(), "decode_i8 gave wrong values"
print(f"cupy {cupy.__version__}, numba.cuda compiles and runs kernels: ok")
EOF

echo "== 2/3 cuda test group on the GPU"
"$PY" -m pytest -q -m cuda tests/test_kernels.py tests/test_cuda.py

echo "== 3/3 end to end: cuda vs cpu"
"$PY" - <<'EOF'
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, "scripts")
import make_models
import onnx

from edgepack.packager.build import build
from edgepack.runtime.session import Session

work = Path(tempfile.mkdtemp(prefix="edgepack-gpu-check-"))
onnx.save(make_models.resnet18(seed=0), work / "resnet18.onnx")
models = {"digits": Path("tests/data/digits_cnn.onnx"), "resnet18": work / "resnet18.onnx"}


def median_ms(ex, feeds, n):
    for _ in range(5):
        ex.run_views(feeds)
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        ex.run_views(feeds)  # includes the output download: GPU work is complete
        t.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(t))


failed = False
print(f"{'model':<10} {'quant':<6} {'max |cuda-cpu|':>15} {'cuda ms':>9} {'cpu ms':>9}")
for name, path in models.items():
    for quant in ("fp32", "fp16", "int8"):
        bundle = work / f"{name}-{quant}.epk"
        build(path, bundle, quant=quant, backends=("cuda", "cpu", "ref"), log=lambda s: None)
        gpu = Session(bundle, device="cuda", require_gpu=True)
        cpu = Session(bundle, device="cpu")
        assert gpu.device == "cuda" and cpu.device == "cpu"
        i = gpu.inputs[0]
        x = np.random.default_rng(0).standard_normal(i["shape"]).astype(np.float32)
        feeds = {i["name"]: x}
        out = gpu.outputs[0]["name"]
        yg, yc = gpu.run(feeds)[out], cpu.run(feeds)[out]
        err = float(np.abs(yg - yc).max())
        scale = float(np.abs(yc).max()) or 1.0
        n = 50 if name == "resnet18" else 200
        tg, tc = median_ms(gpu.executor, feeds, n), median_ms(cpu.executor, feeds, max(10, n // 5))
        ok = err <= 1e-3 * scale + 1e-4  # both sum in float32, in different orders
        failed |= not ok
        print(f"{name:<10} {quant:<6} {err:>15.3e} {tg:>9.3f} {tc:>9.3f}" + ("" if ok else "  FAIL"))
sys.exit(1 if failed else 0)
EOF
echo "gpu_check: all passed"
