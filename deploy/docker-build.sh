#!/usr/bin/env bash
# `make docker`: build Dockerfile.dev into $IMAGE on this machine, whether or not an image registry is reachable.
#
#   1. The Docker engine: when it does not answer and we are root, install docker.io (apt) if dockerd is missing
#      and start it; otherwise say what to do.
#   2. The base image: $BASE_IMAGE when it is here or can be pulled; else a Debian base made locally from Debian's
#      packages (deploy/docker-base.sh -> $LOCAL_BASE).
#   3. The CPU torch wheel of the test tools: from PyTorch's CPU index when reachable; else this machine's pip
#      downloads it (from whatever index or find-links it is configured with) into $MLX_LANE_HOME/docker-wheels
#      and a loopback HTTP server hands it to the build (a constant URL, so the layer stays cached).
#   4. docker build, timed; prints the image size.
#
# Environment: IMAGE, BASE_IMAGE, LOCAL_BASE, MLX_BACKEND (cpu | cuda | cuda12 | cuda13), TORCH_SPEC, TORCH_INDEX_URL,
# TORCH_WHEEL_PORT, PYTHON (the host python whose pip downloads the torch wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-mlx-lane-dev}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
LOCAL_BASE=${LOCAL_BASE:-mlx-lane-base:bookworm}
MLX_BACKEND=${MLX_BACKEND:-cpu}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_WHEEL_PORT=${TORCH_WHEEL_PORT:-38611}
PYTHON=${PYTHON:-python3}
WHEELS=${MLX_LANE_HOME:-$HOME/.cache/mlx-lane}/docker-wheels

ensure_engine() {
  docker info >/dev/null 2>&1 && return 0
  command -v docker >/dev/null 2>&1 || { echo "no docker client: install Docker (Debian: apt-get install docker.io)" >&2; return 1; }
  if [ "$(id -u)" != 0 ]; then
    echo "the Docker engine does not answer: start it (sudo systemctl start docker) or add yourself to the docker group" >&2
    return 1
  fi
  if ! command -v dockerd >/dev/null 2>&1; then
    echo "installing the Docker engine (docker.io)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  if [ -d /run/systemd/system ]; then
    systemctl start docker
  else
    echo "starting dockerd (log: /var/log/dockerd.log)"
    setsid nohup dockerd >/var/log/dockerd.log 2>&1 < /dev/null &
  fi
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
  echo "dockerd did not come up; see /var/log/dockerd.log" >&2
  return 1
}

choose_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image: $BASE_IMAGE (present)" >&2
    echo "$BASE_IMAGE"
  elif docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image: $BASE_IMAGE (pulled)" >&2
    echo "$BASE_IMAGE"
  else
    echo "base image: $BASE_IMAGE cannot be pulled (no registry reachable): using a local Debian base, $LOCAL_BASE" >&2
    bash deploy/docker-base.sh "$LOCAL_BASE" >&2
    echo "$LOCAL_BASE"
  fi
}

# Sets TORCH_ARGS (build flags) and, when it starts one, WHEEL_SERVER_PID.
TORCH_ARGS=()
WHEEL_SERVER_PID=
provide_torch() {
  local base=$1
  if curl -sfI --max-time 10 "$TORCH_INDEX_URL/torch/" >/dev/null 2>&1; then
    echo "torch (test tools): CPU wheel from $TORCH_INDEX_URL"
    TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    return
  fi
  local py arch spec
  py=$(docker run --rm "$base" python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')
  arch=$(uname -m)
  spec="${TORCH_SPEC}+cpu"
  mkdir -p "$WHEELS"
  if ! compgen -G "$WHEELS/torch-${spec#torch==}-cp$py-cp$py-*_$arch.whl" >/dev/null; then
    echo "torch (test tools): $TORCH_INDEX_URL unreachable; downloading $spec for cp$py with this machine's pip"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
      --abi "cp$py" --platform "manylinux_2_28_$arch" "$spec" -d "$WHEELS" || true
  fi
  if compgen -G "$WHEELS/torch-${spec#torch==}-cp$py-cp$py-*_$arch.whl" >/dev/null; then
    echo "torch (test tools): $(cd "$WHEELS" && ls torch-"${spec#torch==}"-cp$py-*.whl), served on 127.0.0.1:$TORCH_WHEEL_PORT"
    "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$TORCH_WHEEL_PORT" >/dev/null 2>&1 &
    WHEEL_SERVER_PID=$!
    for _ in $(seq 50); do curl -sf "http://127.0.0.1:$TORCH_WHEEL_PORT/" >/dev/null && break; sleep 0.1; done
    curl -sf "http://127.0.0.1:$TORCH_WHEEL_PORT/" >/dev/null \
      || { echo "could not serve $WHEELS on port $TORCH_WHEEL_PORT (TORCH_WHEEL_PORT=... picks another)" >&2; exit 1; }
    TORCH_ARGS=(--network host --build-arg TORCH_INDEX_URL= \
                --build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$TORCH_WHEEL_PORT/")
  else
    echo "WARNING: no CPU torch wheel found: the image's test tools get PyPI's torch (the CUDA build, ~3 GB more)" >&2
    TORCH_ARGS=(--build-arg TORCH_INDEX_URL=)
  fi
}

stop_wheel_server() {
  if [ -n "$WHEEL_SERVER_PID" ]; then kill "$WHEEL_SERVER_PID" 2>/dev/null || true; fi
}
trap stop_wheel_server EXIT

# The image keeps MLX_BACKEND set; a plain `cuda` would be re-decided against each machine's driver at run time
# (and reinstall), so it is resolved to cuda12 / cuda13 here, with this machine's driver when it has one.
MLX_BACKEND=$(MLX_BACKEND=$MLX_BACKEND sh deploy/mlx_backend.sh)
ensure_engine
base=$(choose_base)
provide_torch "$base"
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build -f Dockerfile.dev -t "$IMAGE" \
  --build-arg "BASE_IMAGE=$base" --build-arg "MLX_BACKEND=$MLX_BACKEND" "${TORCH_ARGS[@]}" .
size=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')
echo "built $IMAGE (MLX backend $MLX_BACKEND, base $base) in $(( $(date +%s) - start )) s; image size $size"
