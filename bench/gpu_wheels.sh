#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on the device machine, downloaded from the package registries into the checkout's
# git-ignored .whl/ (carried with a call) and .whl1/ (the CUDA wheel's first part, carried alone by the first call:
# a call carries at most 64 MiB). Run once in a fresh checkout, before the first device call:
#
#   bash bench/gpu_wheels.sh            # then: carry [".whl1"] (copy to /tmp/w), then carry [".whl"] (bench/gpu.sh)
#
# The versions are the ones measured since 2026-12-01 (BENCHMARKS.md): mlx / mlx-cuda-13 0.32.4, mlx-lm 0.32.2.
# The device's Python is 3.12 (manylinux_2_35); pydantic_core and orjson ship manylinux2014 tags, websockets
# manylinux_2_5 / 2_28, llguidance 1.9.1 manylinux_2_31 only (without it pip finds <= 1.6.1): every tag is offered.
# The default model's tokenizer (.whl/tok) comes from `make model` (the offline default, SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SPLIT=52428800  # bytes of the CUDA wheel's first part
mkdir -p .whl .whl1 .whl/tok
grep -qx "/.whl1/" .git/info/exclude 2>/dev/null || echo "/.whl1/" >> .git/info/exclude
tags=(--platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
for spec in mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
            pydantic==2.14.4 pydantic_core==2.50.5 orjson==3.13.0 gguf==0.19.0 mlx_vlm==0.7.10 llguidance==1.9.1 \
            prometheus_client websockets; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${tags[@]}" -d .whl "$spec"
done
cuda=$(ls .whl/mlx_cuda_13-*.whl)
sha256sum "$cuda" | cut -d' ' -f1 > .whl/mlx_cuda.sha256
basename "$cuda" > .whl/mlx_cuda.name
head -c $SPLIT "$cuda" > .whl1/mlx_cuda.part1
tail -c +$((SPLIT + 1)) "$cuda" > .whl/mlx_cuda.part2
joined=$(cat .whl1/mlx_cuda.part1 .whl/mlx_cuda.part2 | sha256sum | cut -d' ' -f1)
[ "$joined" = "$(cat .whl/mlx_cuda.sha256)" ] || { echo "gpu_wheels.sh: the two parts do not join into the wheel" >&2; exit 1; }
rm "$cuda"
tok=$(ls -d "${HOME}/.cache/mlx-lane/models/SmolLM2-135M-Instruct" 2>/dev/null || true)
if [ -z "$tok" ]; then
  echo "gpu_wheels.sh: no default model yet: run 'make model', then this again (for .whl/tok)" >&2
  exit 1
fi
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" .whl/tok/
du -sh .whl .whl1
