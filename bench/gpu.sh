#!/usr/bin/env bash
# GPU benchmarks on the device machine: install the carried wheels, then run bench/gpu.py (issue 6, item 3)
# or, with `batch` first, bench/gpu_batch.py (issue 12: concurrent requests).
#
# Wheels (made on the dev machine by bench/gpu_wheels.sh, git-ignored, carried with the call):
#   .whl/*.whl                 mlx==0.32.4, mlx-lm==0.32.2 and the server deps missing on the device image
#                              (+ prometheus_client, websockets, llguidance==1.9.1: its wheel is tagged
#                              manylinux_2_31, so `pip download --platform manylinux_2_31_x86_64`; without it the
#                              server exits at start; httpx comes from the device image; mlx_vlm==0.7.10 (no deps:
#                              models.mtp builds Qwen3.5's and Nemotron-H's MTP heads on its drafters; without it
#                              bench/mtp_fit.py --shape qwen3.5-9b stops at `No module named 'mlx_vlm'`, as on 12-06)
#   .whl/tok/                  tokenizer.json + tokenizer_config.json of the default model (SmolLM2-135M-Instruct)
#   .whl/mlx_cuda.part2, .whl/mlx_cuda.name, .whl/mlx_cuda.sha256
#   $PART1_DIR/mlx_cuda.part1  first part of mlx_cuda_13-0.32.4 (90 MB > one call's 64 MiB), copied there by an
#                              earlier call while the machine is warm; or a whole .whl/mlx_cuda_13-*.whl
#
#   OUT=/some/dir bench/gpu.sh [bench/gpu.py flags...]
#   OUT=/some/dir bench/gpu.sh batch [bench/gpu_batch.py flags...]    # issue 12's batching benchmark instead
#   OUT=/some/dir bench/gpu.sh sharded [bench/gpu_sharded.py flags...] # issue 15: 1 GPU vs 2 GPUs tensor-parallel
#   OUT=/some/dir bench/gpu.sh bench/gpu_write_cost.py [flags...]    # any other GPU script (issue 22: write-behind)
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/mlx-lane-site}
PART1_DIR=${PART1_DIR:-/tmp/w}
OUT=${OUT:-$PWD/.bench/gpu-out}
mkdir -p "$OUT"

if ! PYTHONPATH="$SITE" python3 -c "import mlx.core, mlx_lm, fastapi, uvicorn, orjson, gguf, pydantic, prometheus_client, httpx, llguidance, websockets" 2>/dev/null; then
  cuda=$(ls "$WHL"/mlx_cuda_13-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$cuda" ]; then
    cuda=/tmp/$(cat "$WHL/mlx_cuda.name")
    cat "$PART1_DIR/mlx_cuda.part1" "$WHL/mlx_cuda.part2" > "$cuda"
    echo "$(cat "$WHL/mlx_cuda.sha256")  $cuda" | sha256sum -c -
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHL"/*.whl "$cuda"
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
if ! python3 -c "import mlx_vlm" 2>/dev/null; then  # said at once, before a paid run stops on it
  echo "gpu.sh: mlx_vlm is not importable: bench/mtp_fit.py's Qwen3.5 / Nemotron-H heads need its wheel in $WHL" >&2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
SCRIPT=bench/gpu.py
if [ "${1:-}" = batch ]; then
  SCRIPT=bench/gpu_batch.py
  shift
elif [[ "${1:-}" == bench/*.py ]]; then  # any other in-process GPU script, e.g. bench/gpu_write_cost.py
  SCRIPT=$1
  shift
elif [ "${1:-}" = sharded ]; then  # issue 15: one GPU vs tensor-parallel over 2 (needs 2 GPUs: nvidia-h200-x2)
  SCRIPT=bench/gpu_sharded.py
  shift
fi
python3 "$SCRIPT" --out "$OUT" "$@"
