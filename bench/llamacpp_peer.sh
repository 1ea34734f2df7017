#!/usr/bin/env bash
# Builds llama.cpp's server (llama-cpp-python[server]) once and keeps it under the bench cache:
#   $MLX_LANE_HOME/bench/wheels/llama_cpp_python-*.whl   (compiling llama.cpp takes ~19 min on 2 cores)
#   $MLX_LANE_HOME/bench/llamacpp-venv                   (a venv of its own, so it never touches .venv)
# Prints the venv's python on the last line. Idempotent: a second run reuses both.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HOME_DIR="${MLX_LANE_HOME:-$HOME/.cache/mlx-lane}"
WHEELS="$HOME_DIR/bench/wheels"
VENV="$HOME_DIR/bench/llamacpp-venv"
PY="${PYTHON:-python3}"

mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python==$VERSION from source (compiles llama.cpp: ~19 min on 2 cores)" >&2
    # CPU build; GGML_NATIVE tunes for this CPU, which is the one the benchmark runs on.
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$PY" -m pip wheel --no-deps --no-binary llama-cpp-python -w "$WHEELS" "llama-cpp-python==$VERSION" >&2
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q "$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)[server]" >&2
fi
echo "$VENV/bin/python"
