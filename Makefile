# Quick start: `make run` (install + the main job) and `make test` (install + the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gemmaserve-installed
PLUGINS := plugins/hf_torch plugins/custom_torch plugins/mlx
PLUGIN_FILES := $(wildcard plugins/*/pyproject.toml)

.PHONY: run test install load clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(VENV)/bin/python pyproject.toml requirements-dev.txt $(PLUGIN_FILES)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation -e '.[router,kv-events]' $(foreach p,$(PLUGINS),$(if $(wildcard $(p)/pyproject.toml),-e $(p)))
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/gemmaserve demo

# Tests and `make run` share the converted default model (converted once, then reused).
export GEMMASERVE_CACHE_DIR ?= $(HOME)/.cache/gemmaserve

test: install
	$(PY) -m pytest -q

# The long load test (outside CI): 512 streaming requests, 256 concurrent, against a real server.
load: install
	$(PY) tests/reliability/loadgen.py --requests 512 --concurrency 256

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
