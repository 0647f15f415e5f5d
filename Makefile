# Two entry points for a fresh machine: `make serve` and `make test`.
# Each creates (or reuses) .venv and installs what it needs; the stamps make reruns cheap.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint format generate clean

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

test: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(TEST_STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
