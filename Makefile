# vitserve: the two commands are `make serve` and `make test`; `make help` lists the rest.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
BENCH_ARGS ?=

# make train / make export
PRESET ?= fashion-small
DATASET ?= fashion-mnist
RUN ?= runs/$(PRESET)
MODEL ?= fashion-mnist-vit
VERSION ?= 2
REPO ?= models

BIN := $(VENV)/bin
VPY := $(BIN)/python
PIP := $(VPY) -m pip install --disable-pip-version-check --quiet

SERVE_REQS := requirements/serve.txt
TEST_REQS := requirements/serve.txt requirements/export.txt requirements/dev.txt
# A stamp per set of requirements, named after the files' hash: a second run installs nothing, and a
# change to any pinned file installs again.
req_hash = $(shell cat $(1) | sha256sum | cut -c1-16)
SERVE_STAMP := $(VENV)/.installed-serve-$(call req_hash,$(SERVE_REQS))
EXPORT_REQS := requirements/serve.txt requirements/export.txt
EXPORT_STAMP := $(VENV)/.installed-export-$(call req_hash,$(EXPORT_REQS))
TEST_STAMP := $(VENV)/.installed-test-$(call req_hash,$(TEST_REQS))
# make image-test: the Compose CLI and the clients its checks use, never torch (the export image
# brings its own).
IMAGE_TEST_REQS := requirements/serve.txt requirements/dev.txt
IMAGE_TEST_STAMP := $(VENV)/.installed-image-test-$(call req_hash,$(IMAGE_TEST_REQS))

# The Kubernetes version the manifests in deploy/kubernetes/ are validated against (kubernetes-validate
# ships its schemas, so the check needs no cluster and no network).
K8S_VERSION := 1.35.0
K8S_MANIFESTS := $(sort $(shell find deploy/kubernetes -name '*.yaml' -o -name '*.yml'))

DATASET_DIR := /usr/share/datasets/fashion-mnist
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# $(call apt_install,PACKAGE): install a Debian package, updating the package lists first if need be
apt_install = export DEBIAN_FRONTEND=noninteractive; \
	$(SUDO) apt-get install -y --no-install-recommends $(1) \
	|| { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends $(1); }

.PHONY: help serve export-env test lint format hadolint compose-check k8s-check pytest dataset chromium hey wrk train \
	export bench mutation docker-build image-test clean

help: ## List the targets.
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VPY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11 or newer needed, found {sys.version}"'
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): | $(VPY)
	$(PIP) -r $(SERVE_REQS)
	rm -f $(VENV)/.installed-serve-*
	touch $@

$(EXPORT_STAMP): | $(VPY)
	$(PIP) $(addprefix -r ,$(EXPORT_REQS))
	rm -f $(VENV)/.installed-export-*
	touch $@

$(IMAGE_TEST_STAMP): | $(VPY)
	$(PIP) $(addprefix -r ,$(IMAGE_TEST_REQS))
	rm -f $(VENV)/.installed-image-test-*
	touch $@

$(TEST_STAMP): | $(VPY)
	$(PIP) $(addprefix -r ,$(TEST_REQS))
	rm -f $(VENV)/.installed-test-* $(VENV)/.installed-serve-* $(VENV)/.installed-export-*
	touch $@ $(SERVE_STAMP) $(EXPORT_STAMP)

serve: $(SERVE_STAMP) ## Serve the shipped model at http://127.0.0.1:PORT (PORT=8000; gRPC on PORT+1); installs no torch.
	@echo "vitserve: http://$(HOST):$(PORT)  (OpenAPI docs: http://$(HOST):$(PORT)/docs; gRPC: $(HOST):$${VITSERVE_GRPC_PORT:-$$(( $(PORT) + 1 ))})"
	VITSERVE_HOST=$(HOST) VITSERVE_PORT=$(PORT) exec $(VPY) -m service

export-env: $(EXPORT_STAMP) ## Install what training and export need into .venv (torch for the CPU; after `make serve`).

test: lint hadolint compose-check k8s-check pytest ## Lint, check the Dockerfile, compose file and Kubernetes manifests, run every test.

lint: $(TEST_STAMP) ## ruff check and ruff format --check.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(TEST_STAMP) ## Fix what ruff can and format the code.
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

hadolint: $(TEST_STAMP) ## Lint the Dockerfile (rules in .hadolint.yaml).
	$(BIN)/hadolint Dockerfile

compose-check: $(TEST_STAMP) ## Validate docker-compose.yml, alone and with compose.cpu.yaml (no Docker engine needed).
	$(BIN)/docker-compose -f docker-compose.yml --profile export --profile export-gpu config --quiet
	$(BIN)/docker-compose -f docker-compose.yml -f compose.cpu.yaml --profile export config --quiet

# Every file there holds complete resources of the core API; deploy/kserve/'s InferenceService is a
# CRD, which kubernetes-validate has no schema for: tests/delivery/test_kubernetes.py checks it.
k8s-check: $(TEST_STAMP) ## Validate deploy/kubernetes/ offline (kubernetes-validate --strict, K8S_VERSION).
	$(BIN)/kubernetes-validate --strict --kubernetes-version $(K8S_VERSION) $(K8S_MANIFESTS)

# Two passes: the tests not marked serial on TEST_WORKERS processes (pytest-xdist), then the serial
# ones alone (tests/conftest.py: they time the service or load it). The first pass gives each worker
# half of the tests in the order collected, and a worker that runs out takes half of what the other
# has left (--dist worksteal): a module's fixtures (a server, a training run, an export) are mostly
# made once, not on both workers, and neither waits idle at the end. Not --dist loadfile: when
# pytest-timeout ends a hung test's worker, pytest-xdist 3.8's loadfile runs that test again on each
# replacement, drops the rest of its file, and can wait forever at the end of the run. pytest exits 5 when it collected
# no test: that fails here, but for a pass that PYTEST_ARGS left empty (`PYTEST_ARGS=tests/export`).
# Both passes share one export of the tests' tiny model (TESTS_MODEL_CACHE, tests/conftest.py), in a
# fresh directory removed after them.
pytest: $(TEST_STAMP) dataset chromium hey ## Run the test suite (PYTEST_ARGS: pytest's arguments).
	cache=$$(mktemp -d); trap 'rm -rf "$$cache"' EXIT; export TESTS_MODEL_CACHE=$$cache; \
	$(VPY) -m pytest -n $(TEST_WORKERS) -m "not serial" --dist worksteal $(PYTEST_ARGS) || { s=$$?; [ $$s = 5 ] && [ -n "$(PYTEST_ARGS)" ] || exit $$s; }; \
	$(VPY) -m pytest -m serial $(PYTEST_ARGS) || { s=$$?; [ $$s = 5 ] && [ -n "$(PYTEST_ARGS)" ] || exit $$s; }

dataset: ## Install Debian's dataset-fashion-mnist when its files are missing.
	@missing=0; \
	for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do \
		[ -e $(DATASET_DIR)/$$f ] || [ -e $(DATASET_DIR)/$$f.gz ] || missing=1; \
	done; \
	if [ $$missing = 0 ]; then \
		echo "Fashion-MNIST: $(DATASET_DIR)"; \
	else \
		$(call apt_install,dataset-fashion-mnist); \
	fi

chromium: ## Install Debian's chromium (for the demo page's browser test) when it is missing.
	@if [ -x /usr/bin/chromium ]; then echo "Chromium: /usr/bin/chromium"; \
	else $(call apt_install,chromium); fi

hey: ## Install Debian's hey (the benchmarks' load generator, run by tests/bench/) when it is missing.
	@if command -v hey >/dev/null; then echo "hey: $$(command -v hey)"; \
	else $(call apt_install,hey); fi

wrk: ## Install Debian's wrk (python -m bench.cost's load generator) when it is missing.
	@if command -v wrk >/dev/null; then echo "wrk: $$(command -v wrk)"; \
	else $(call apt_install,wrk); fi

train: $(TEST_STAMP) dataset ## Train a ViT: PRESET=fashion-small RUN=runs/fashion-small.
	$(VPY) -m export.train --preset $(PRESET) --dataset $(DATASET) --out $(RUN)

export: $(TEST_STAMP) dataset ## Export RUN to ONNX as models/MODEL/VERSION.
	$(VPY) -m export.onnx $(RUN) --name $(MODEL) --version $(VERSION) --repo $(REPO)

bench: $(TEST_STAMP) ## Run the benchmarks on a quiet machine (BENCH_ARGS=--quick: a smoke run); writes BENCHMARKS.md.
	@if ! command -v hey >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y --no-install-recommends hey \
		|| { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends hey; }; \
	fi
	$(VPY) -m bench $(BENCH_ARGS)

# make mutation: every mutant of the core modules ([tool.mutmut] in pyproject.toml), or those whose
# name matches MUTATE (e.g. MUTATE='service.frontend.security*'); niced, and stopped after MUTATION_LIMIT.
MUTATE ?=
MUTATION_LIMIT ?= 2h
MUTATION_CHILDREN ?= 2
MUTATION_NICE ?= 10
mutation: $(TEST_STAMP) dataset ## Mutation testing of the core modules (docs/testing.md); not in `make test`.
	rm -rf mutants
	set -f; MUTATION_MODULES='$(MUTATE)' TESTS_MODEL_CACHE=$(CURDIR)/mutants/.model-cache \
		timeout $(MUTATION_LIMIT) nice -n $(MUTATION_NICE) \
		$(BIN)/mutmut run --max-children $(MUTATION_CHILDREN) $(MUTATE)
	$(BIN)/mutmut results

docker-build: ## Build the three images (needs a Docker engine with BuildKit).
	docker build --target service --build-arg VARIANT=cpu -t vitserve:cpu .
	docker build --target service --build-arg VARIANT=gpu -t vitserve:gpu .
	docker build --target export -t vitserve:export .

# Where no Docker daemon answers: podman (its Docker API drives the Compose CLI), runc, and mmdebstrap
# for a stand-in base image where no registry can be reached (deploy/image_test/, docs/containers.md).
IMAGE_TEST_PACKAGES := podman runc mmdebstrap uidmap slirp4netns fuse-overlayfs
image-test: $(IMAGE_TEST_STAMP) dataset ## Build the CPU service and export images, run them with compose and check them (docs/containers.md).
	@if timeout 30 docker info >/dev/null 2>&1; then echo "Docker: its daemon answers"; \
	elif command -v podman >/dev/null && command -v runc >/dev/null && command -v mmdebstrap >/dev/null; then \
		echo "podman: $$(command -v podman)"; \
	else $(call apt_install,$(IMAGE_TEST_PACKAGES)); fi
	$(VPY) -m deploy.image_test

clean: ## Remove the virtual environments, caches and test artifacts (never runs/ or models/).
	rm -rf $(VENV) .venv-mosec .venv-triton .pytest_cache .ruff_cache .hypothesis test-artifacts mutants
	rm -f wheels/*.whl
	find . -path ./runs -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
