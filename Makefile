# mlx-lane: `make serve` sets everything up and starts the server; `make test` runs the suite.
# Both are idempotent: the venv, the OpenBLAS runtime and the default model are made once.

PYTHON   ?= python3
VENV     ?= .venv
# e.g. --system-site-packages: reuse a Python that already has the CUDA libraries (the nvidia-* wheels)
VENV_ARGS ?=
BIN      := $(VENV)/bin
# MLX's backend is a pyproject extra: cpu, cuda12, cuda13 (Linux) or metal (macOS). deploy/mlx_backend.sh picks it
# (an NVIDIA GPU answering nvidia-smi -> CUDA, else cpu); MLX_BACKEND=cpu|cuda|cuda12|cuda13 overrides. One stamp
# per backend, so a changed choice reinstalls.
MLX_EXTRA := $(shell sh deploy/mlx_backend.sh 2>/dev/null)
STAMP    := $(VENV)/.installed-$(MLX_EXTRA)
HOST     ?= 127.0.0.1
PORT     ?= 8080
ARGS     ?=
PYTEST_ARGS ?=
# torch (+ accelerate, which transformers' GGUF loader needs) is only the independent oracle of the
# GGUF conversion test; never a runtime dependency. torch first, so accelerate cannot pull another build.
TORCH_SPEC ?= torch==2.13.0
ACCELERATE_SPEC ?= accelerate==1.15.0

.PHONY: serve test test-suite test-setup typecheck venv blas browser haproxy system-packages model test-deps cluster bench soak clean help docker docker-test

help:
	@echo "make serve       - create .venv, install, get + convert the default model, serve on $(HOST):$(PORT)"
	@echo "make test        - the whole test suite, the type checker beside it (installs what it needs; TEST_WORKERS=2 processes)"
	@echo "make typecheck   - the type checker alone (mypy over server/, cache/, models/, spec/)"
	@echo "make cluster     - REPLICAS (default 2) replicas behind HAProxy on $(HOST):$(PORT), sharing one SSD cache"
	@echo "make bench       - run the CPU benchmarks and rewrite BENCHMARKS.md"
	@echo "make browser     - install Chromium (apt, as root) for the dashboard's browser tests (make test does it)"
	@echo "make docker      - build the $(IMAGE) image from Dockerfile.dev (a local Debian base when no registry)"
	@echo "make docker-test - run the whole test suite inside that image"

# The backend packages (mlx-cpu, mlx-cuda-12, mlx-cuda-13) all ship mlx/lib/libmlx.so: when one other than the
# chosen one is installed, all are removed before installing, so no file of the old backend is left behind.
$(STAMP): pyproject.toml
	@sh deploy/mlx_backend.sh --explain
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if $(BIN)/python -m pip list --format=freeze 2>/dev/null | grep -iE '^mlx[-_](cpu|cuda[-_]1[23])==' \
		| grep -viqE '^mlx[-_]$(subst cuda,cuda[-_],$(MLX_EXTRA))=='; then \
		echo "mlx-lane: removing the previously installed MLX backend"; \
		$(BIN)/python -m pip uninstall -y -q mlx-cpu mlx-cuda-12 mlx-cuda-13 2>/dev/null; \
	fi
	$(BIN)/python -m pip install -q -e '.[test,$(MLX_EXTRA)]'
	@rm -f $(VENV)/.installed $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

# Debian packages outside the venv (deploy/system_packages.sh says what each is for): installed with apt-get as root
# when missing, otherwise a warning says how. `make test` asks for all three in one apt-get.
blas:
	@sh deploy/system_packages.sh blas

browser:
	@sh deploy/system_packages.sh browser

haproxy:
	@sh deploy/system_packages.sh haproxy

system-packages:
	@sh deploy/system_packages.sh blas browser haproxy

model: venv
	$(BIN)/python -c "from models import ensure_default_model; print(ensure_default_model())"
	@$(BIN)/python -c "from models.embedding import ensure_default_embedding_model as e; print(e())" \
		|| echo "WARNING: the default embedding model could not be fetched: /v1/embeddings will be off (the rest works)"

serve: venv blas model
	$(BIN)/mlx-lane serve --host $(HOST) --port $(PORT) $(ARGS)

# The vision extra (mlx-vlm) for the image tests: its own files and the two packages images use (Pillow, requests),
# without the ~0.8 GB of dependencies it declares for audio, video and datasets (pip install -e '.[vision]' brings
# those too; the server needs none of them).
VISION_SPEC ?= mlx-vlm==0.7.10
test-deps: venv
	@$(BIN)/python -c "import mlx_vlm" 2>/dev/null || { $(BIN)/python -m pip install -q --no-deps "$(VISION_SPEC)" \
		&& $(BIN)/python -m pip install -q "Pillow>=10.3" "requests>=2.31"; }
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	@$(BIN)/python -c "import accelerate" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" "$(ACCELERATE_SPEC)"

# N replicas of `mlx-lane serve` (ARGS go to each) behind HAProxy on HOST:PORT; replicas on PORT+1.. share the SSD
# cache folder (SSD_CACHE, default ~/.cache/mlx-lane/kv). Ctrl-C stops everything. See README "More than one machine".
REPLICAS ?= 2
SSD_CACHE ?=
cluster: venv blas model haproxy
	$(BIN)/python deploy/cluster.py --replicas $(REPLICAS) --host $(HOST) --port $(PORT) --base-port $$(($(PORT) + 1)) \
		$(if $(SSD_CACHE),--ssd-cache $(SSD_CACHE)) -- $(ARGS)

# Setup in parallel (the Debian packages beside the venv, then the model beside the test tools), then the suite in
# TEST_WORKERS pytest-xdist processes (0: one process), a test file per worker at a time: the module-scoped live
# servers start once, and each test server takes its own free port and temporary folders. The type checker (mypy,
# [tool.mypy] in pyproject.toml: its cache in .mypy_cache) runs beside the suite at the lowest priority (on a fresh
# clone it has no cache: ~60 s of one core, which it takes from the suite's idle moments instead of from its
# servers), its report printed after it; either
# failing fails `make test`. The 15 slowest tests are listed (the suite must stay under 15 minutes on 2 cores); the
# last line says how long the whole of `make test` took, the setup included.
TEST_WORKERS ?= 2
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-suite; rc=$$?; \
		echo "make test: exit $$rc after $$(( $$(date +%s) - start )) s (setup included)"; exit $$rc

typecheck: venv
	$(BIN)/python -m mypy

test-setup: venv system-packages model test-deps

# (GNU make 3.81, macOS's, has no --output-sync: its parallel setup's lines interleave)
OUTPUT_SYNC := $(if $(filter 3.%,$(MAKE_VERSION)),,--output-sync=target)
test-suite:
	@$(MAKE) --no-print-directory -j3 $(OUTPUT_SYNC) test-setup
	@nice -n 19 $(BIN)/python -m mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/python -m pytest -q -ra --durations=15 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS); \
	tests=$$?; wait $$types; typed=$$?; \
	echo "type checker (mypy):"; cat $(VENV)/mypy.log; \
	if [ $$typed -ne 0 ]; then echo "make test: the type checker failed (above)"; fi; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$typed

# CPU benchmarks, each alternated against its peers in one run; each script writes its JSON (with a preflight of
# the machine's load, memory and busiest processes) into bench/results/, then report.py regenerates the
# <!-- bench:NAME --> sections of BENCHMARKS.md from them. The peers: mlx_lm.server, and llama.cpp's server
# (bench/llamacpp_peer.sh compiles llama-cpp-python once, ~19 min on 2 cores, kept under ~/.cache/mlx-lane/bench).
# Whole run: about 1.5 h on 2 cores before concurrent_agents (~50 min more while mlx-lane's lane is serial, 2
# rounds of K 1,4,8,16) and batch_text_match (~5 min). pipefail: a failed script stops the
# run instead of hiding behind tee. AGENT_REPLAY sets the replay's size.
AGENT_REPLAY ?= --convs 8 --turns 6
bench: SHELL := bash
bench: .SHELLFLAGS := -o pipefail -c
bench: venv blas model haproxy
	$(BIN)/python bench/decode_overhead.py --rounds 5 --tokens 64 | tee bench/results/decode_overhead.txt
	$(BIN)/python bench/warm_hit.py --rounds 7 --context 1024 | tee bench/results/warm_hit.txt
	$(BIN)/python bench/ssd_restart.py --rounds 3 --context 4000 | tee bench/results/ssd_restart.txt
	$(BIN)/python bench/speculative.py --rounds 3 --tokens 200 | tee bench/results/speculative.txt
	$(BIN)/python bench/quant_speed.py --rounds 3 --tokens 64 --prompt-tokens 256 | tee bench/results/quant_speed.txt
	bash bench/llamacpp_peer.sh
	$(BIN)/python bench/single_request.py --servers ours,mlx_lm,llama_cpp --rounds 3 | tee bench/results/single_request.txt
	$(BIN)/python bench/agent_replay.py --servers ours,mlx_lm,llama_cpp $(AGENT_REPLAY) | tee bench/results/agent_replay.txt
	$(BIN)/python bench/agent_replay.py --servers ours,mlx_lm,llama_cpp --convs 4 --turns 4 --restart-after-turn 2 \
		--out bench/results/agent_replay_restart.json --plot bench/agent_replay_restart_ttft.png \
		| tee bench/results/agent_replay_restart.txt
	$(BIN)/python bench/concurrent_agents.py --servers ours,mlx_lm,llama_cpp --k 1,4,8,16 --turns 3 --max-tokens 64 \
		--rounds 2 | tee bench/results/concurrent_agents.txt
	$(BIN)/python bench/batch_text_match.py --servers ours --n 24 --max-tokens 32 --repeat-alone \
		| tee bench/results/batch_text_match.txt
	$(BIN)/python bench/cluster_affinity.py --k 5 --turns 3 --max-tokens 16 | tee bench/results/cluster_affinity.txt
	$(BIN)/python bench/report.py --write BENCHMARKS.md

# 1,000 requests under a 48 MiB RAM cache; the RSS / cache-bytes curve goes to bench/results/soak_curve.json.
# Then 10 kill -9 trials during SSD writes (make test runs 3); -s prints where each kill landed.
soak: venv blas model
	MLX_LANE_SOAK_REQUESTS=1000 MLX_LANE_SOAK_CAP_MIB=48 MLX_LANE_SOAK_CURVE=bench/results/soak_curve.json \
		$(BIN)/python -m pytest -q tests/integration/test_cache_soak.py
	MLX_LANE_KILL_TRIALS=10 $(BIN)/python -m pytest -q -s tests/reliability/test_kill_ssd.py

# Docker: deploy/docker-build.sh starts the engine if it can, uses BASE_IMAGE when it can be pulled and otherwise
# makes a Debian base image locally (deploy/docker-base.sh), finds the CPU torch wheel for the test tools, then
# builds Dockerfile.dev. docker-test runs the suite inside (SYS_ADMIN: the full-disk test mounts a tmpfs).
IMAGE       ?= mlx-lane-dev
BASE_IMAGE  ?= python:3.11-slim-bookworm
LOCAL_BASE  ?= mlx-lane-base:bookworm
DOCKER_TEST_FLAGS ?= --cap-add SYS_ADMIN
docker:
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) LOCAL_BASE=$(LOCAL_BASE) TORCH_SPEC=$(TORCH_SPEC) \
		MLX_BACKEND=$(or $(MLX_BACKEND),cpu) bash deploy/docker-build.sh

docker-test:
	docker run --rm $(DOCKER_TEST_FLAGS) $(IMAGE) make test PYTEST_ARGS="$(PYTEST_ARGS)"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
