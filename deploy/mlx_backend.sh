#!/bin/sh
# Which MLX backend `make venv` installs, as the name of the pyproject extra: cpu, cuda12, cuda13 or metal.
#
#   deploy/mlx_backend.sh            # prints the extra, e.g. "cuda13"
#   deploy/mlx_backend.sh --explain  # prints one line saying what was chosen and why
#
# Policy: MLX_BACKEND (cpu | cuda | cuda12 | cuda13) wins. Otherwise macOS -> metal; Linux where `nvidia-smi -L`
# lists a GPU -> CUDA, else cpu. CUDA 13 when the driver supports it (nvidia-smi's "CUDA Version: 13.x" or later),
# else CUDA 12 (MLX's own `mlx[cuda]` default, which drivers too old for 13 still run); `cuda` means the same.
set -u

gpu_name() {
  command -v nvidia-smi >/dev/null 2>&1 || return 1
  nvidia-smi -L 2>/dev/null | sed -n 's/^GPU [0-9]*: \([^(]*\).*/\1/p' | head -1 | sed 's/ *$//' | grep .
}

driver_cuda_major() {
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -1
}

cuda_extra() {
  major=$(driver_cuda_major)
  if [ -n "$major" ] && [ "$major" -ge 13 ]; then echo cuda13; else echo cuda12; fi
}

case "${MLX_BACKEND:-}" in
  "")
    if [ "$(uname -s)" = Darwin ]; then
      extra=metal why="macOS"
    elif name=$(gpu_name); then
      extra=$(cuda_extra)
      why="nvidia-smi lists $name, driver CUDA $(driver_cuda_major | grep . || echo unknown)"
    else
      extra=cpu why="no NVIDIA GPU answers nvidia-smi"
    fi ;;
  cpu | cuda12 | cuda13) extra=$MLX_BACKEND why="MLX_BACKEND=$MLX_BACKEND" ;;
  cuda) extra=$(cuda_extra) why="MLX_BACKEND=cuda, driver CUDA $(driver_cuda_major | grep . || echo unknown)" ;;
  *)
    echo "MLX_BACKEND=$MLX_BACKEND is not one of cpu, cuda, cuda12, cuda13" >&2
    exit 2 ;;
esac

if [ "${1:-}" = --explain ]; then
  echo "mlx-lane: MLX backend $extra ($why; MLX_BACKEND=cpu|cuda overrides)"
else
  echo "$extra"
fi
