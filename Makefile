# Two entry points for a fresh machine: `make serve` and `make test`.
# Each creates (or reuses) .venv and installs what it needs; the stamps make reruns cheap.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# The sdk-appliance client (PyPI cerebras-sdk) ships cp311 wheels only and pins numpy 1.25, so it gets
# its own environment; the repository goes on its PYTHONPATH (docs/kernels.md, "Appliance"). The
# loopback worker in the tests runs the simulator there too, hence threadpoolctl (wafer/sim/parallel.py).
PYTHON311 ?= python3.11
APPLIANCE_VENV ?= .venv-appliance
APPLIANCE_STAMP := $(APPLIANCE_VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# `make loadtest`: locust against a server on the simulator (loadtest/run.py); reports in out/loadtest/.
LOADTEST_DURATION ?= 60s
LOADTEST_USERS ?= 16

.PHONY: serve test lint format generate clean appliance-venv loadtest

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

serve: $(RUN_STAMP)
	$(VENV)/bin/wafer-gpt2 serve --host $(HOST) --port $(PORT)

generate: $(RUN_STAMP)
	$(VENV)/bin/wafer-gpt2 generate "The meaning of life is"

test: $(TEST_STAMP) $(APPLIANCE_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(TEST_STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

loadtest: $(TEST_STAMP) $(APPLIANCE_STAMP)
	$(PY) loadtest/run.py --duration $(LOADTEST_DURATION) --users $(LOADTEST_USERS) --out out/loadtest

clean:
	rm -rf $(VENV) $(APPLIANCE_VENV) .pytest_cache build *.egg-info out

appliance-venv: $(APPLIANCE_STAMP)

$(APPLIANCE_STAMP): Makefile
	test -x $(APPLIANCE_VENV)/bin/python || $(PYTHON311) -m venv $(APPLIANCE_VENV)
	$(APPLIANCE_VENV)/bin/pip install -q cerebras-sdk==2.10.0 cerebras-appliance==2.10.0 'threadpoolctl>=3.1'
	touch $@
