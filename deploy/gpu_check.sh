#!/usr/bin/env bash
# On an NVIDIA machine without a package registry: a fresh checkout's `make serve` must pick MLX's CUDA backend
# and serve on the GPU. Uses the parts made by deploy/gpu_bundle.sh.
#
# The device tool carries one part a call (<= 64 MiB) and keeps the machine warm between calls, so:
#   call 1..N-1:  mkdir -p /tmp/w && cp .whl/gpu-bundle/partNN /tmp/w/        (carry: [".whl/gpu-bundle/partNN"])
#   call N:       cp .whl/gpu-bundle/part* .whl/gpu-bundle/SHA256SUMS /tmp/w/ && deploy/gpu_check.sh
#                                       (carry: the last part and ".whl/gpu-bundle/SHA256SUMS")
# The venv reuses the machine's Python (--system-site-packages) for the CUDA libraries mlx-cuda-13 needs
# (nvidia-* wheels), which are too large to carry. Writes serve.log, stats.json and chat.json under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${PARTS:-/tmp/w}
PORT=${PORT:-8080}
OUT=${OUT:-$PWD/.bench/gpu-check}
mkdir -p "$OUT"

rm -rf /tmp/gpu-bundle && mkdir -p /tmp/gpu-bundle
cat "$PARTS"/part* > /tmp/gpu-bundle/bundle.tar
(cd /tmp/gpu-bundle && sha256sum -c "$PARTS/SHA256SUMS")
tar -C /tmp/gpu-bundle -xf /tmp/gpu-bundle/bundle.tar
export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/gpu-bundle/wheels
# A fresh venv and model home, whatever earlier calls left on the machine.
export MLX_LANE_HOME=/tmp/gpu-check-home VENV=/tmp/gpu-check-venv
rm -rf "$MLX_LANE_HOME" "$VENV"

nvidia-smi -L
sh deploy/mlx_backend.sh --explain

# This device has no registry and its Python has no nvidia-* distributions registered (its CUDA libraries come from
# the system), so pip cannot resolve mlx-cuda-13's nvidia-* requirements here: with NO_DEPS=1 the venv gets every
# bundled wheel without dependency resolution first, and make's own `pip install -e '.[test,cuda13]'` then runs
# with PIP_NO_DEPS. On a GPU machine with a registry, `make serve` alone fetches them.
if [ "${NO_DEPS:-1}" = 1 ]; then
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps /tmp/gpu-bundle/wheels/*.whl
  export PIP_NO_DEPS=1
fi

start=$(date +%s)
setsid make serve VENV="$VENV" VENV_ARGS=--system-site-packages HOST=127.0.0.1 PORT="$PORT" > "$OUT/serve.log" 2>&1 &
pgid=$!
trap 'kill -- -$pgid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "localhost:$PORT/health" >/dev/null && break
  kill -0 "$pgid" 2>/dev/null || { tail -40 "$OUT/serve.log"; echo "make serve exited" >&2; exit 1; }
  sleep 1
done
echo "make serve answered /health after $(( $(date +%s) - start )) s"
grep -E "MLX backend|device" "$OUT/serve.log" | head -5 || true
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^mlx' || true
curl -sf "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":16}' | tee "$OUT/chat.json"
echo
curl -sf "localhost:$PORT/stats" | tee "$OUT/stats.json" | "$VENV/bin/python" -c \
  'import json,sys; s=json.load(sys.stdin); print("stats: device", s.get("device"), "dtype", s.get("dtype"))'
