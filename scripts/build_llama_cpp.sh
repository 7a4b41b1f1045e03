#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize, llama-simple (scripts/bench_llm.py) and
# llama-server (scripts/bench_serve.py),
# from the source the llama-cpp-python sdist vendors (PyPI is the only network there is).
#
#     bash scripts/build_llama_cpp.sh [DIR]     # default DIR: ~/.cache/edgepack/llama.cpp
#
# Takes ~9 minutes on two cores. A CPU build for this machine (GGML_NATIVE), no CURL,
# static libraries; the binaries land in DIR/bin. Rerunning with DIR already built only
# reports what is there.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${1:-${HOME}/.cache/edgepack/llama.cpp}"
PY="${PYTHON:-$(command -v python || command -v python3)}"

if [ -x "$DIR/bin/llama-bench" ] && [ -x "$DIR/bin/llama-quantize" ] && [ -x "$DIR/bin/llama-server" ]; then
    echo "llama.cpp already built in $DIR/bin ($(cat "$DIR/commit" 2>/dev/null || echo '?'))"
    exit 0
fi
mkdir -p "$DIR/src"
"$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/src"
tar -xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
# the vendored tree has no .git: its commit is in the sdist's metadata when present
(grep -rho 'LLAMA_COMMIT[^"]*"[0-9a-f]*"' "$SRC" 2>/dev/null | head -1 || true) > "$DIR/commit"
cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$DIR/build" -j "$(nproc)" --target llama-bench llama-quantize llama-simple \
    llama-server
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-bench" "$DIR/build/bin/llama-quantize" "$DIR/build/bin/llama-simple" \
    "$DIR/build/bin/llama-server" "$DIR/bin/"
echo "built llama.cpp in $DIR/bin"
