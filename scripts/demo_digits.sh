#!/usr/bin/env bash
# Pack the shipped digits CNN (tests/data/digits_cnn.onnx) into two bundles, int8 and
# fp32, then classify one image of the held-out test set with the int8 bundle and
# print the true label under the prediction.
#
#     pip install -e '.[dev]' && bash scripts/demo_digits.sh
#
# Needs numpy, onnx and scikit-learn (all in the dev extra); torch is not needed
# because the .onnx is committed. Writes into dist/ at the repository root.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The interpreter pip installed into; `python3` where there is no `python`.
PY="${PYTHON:-$(command -v python || command -v python3)}"

# The `edgepack` console script, or the same entry point through the interpreter when
# pip put the script somewhere that is not on PATH.
edgepack() {
    if command -v edgepack >/dev/null 2>&1; then
        command edgepack "$@"
    else
        "$PY" -m edgepack.cli "$@"
    fi
}

mkdir -p dist

echo "== build dist/digits-int8.epk (int8 weights)"
edgepack build tests/data/digits_cnn.onnx -o dist/digits-int8.epk --quant int8
echo
echo "== build dist/digits.epk (fp32)"
edgepack build tests/data/digits_cnn.onnx -o dist/digits.epk
echo

# Test image 0 of the split the model was trained against (scripts/train_digits.py),
# shaped [1, 1, 8, 8] float32 like the bundle's input; its label goes next to it.
label="$("$PY" - <<'PYEOF'
import sys

import numpy as np

sys.path.insert(0, "scripts")
from train_digits import load_split

_, X_test, _, y_test = load_split()
np.save("dist/digit.npy", X_test[0:1])
label = int(y_test[0])
with open("dist/digit-label.txt", "w") as f:
    f.write(f"{label}\n")
print(label)
PYEOF
)"
echo "== wrote dist/digit.npy (test image 0) and dist/digit-label.txt"
echo

echo "== edgepack run dist/digits-int8.epk --input dist/digit.npy"
edgepack run dist/digits-int8.epk --input dist/digit.npy
echo "true label: ${label}"
