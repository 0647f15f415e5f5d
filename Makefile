# Two entry points for a fresh machine: `make serve` and `make test` (`make test-fast` is the inner loop).
# Each creates (or reuses) .venv and installs what it needs; the stamps make reruns cheap.
PYTHON ?= python3
# Python keeps the bytecode of what it imports: where the environment sets PYTHONDONTWRITEBYTECODE (as
# some CI images do), every test's server or CLI process would compile torch, transformers and the
# service's modules from source again (a quarter of a 4-file sample of the suite's time).
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# The sdk-appliance client (PyPI cerebras-sdk) ships cp311 wheels only and pins numpy 1.25, so it gets
# its own environment; the repository goes on its PYTHONPATH (docs/kernels.md, "Appliance"). The
# loopback worker in the tests runs the simulator there too, hence threadpoolctl (wafer_gpt2/sim/parallel.py).
PYTHON311 ?= python3.11
APPLIANCE_VENV ?= .venv-appliance
APPLIANCE_STAMP := $(APPLIANCE_VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# `make loadtest`: locust against a server on the simulator (tools/loadtest/run.py); reports in out/loadtest/.
LOADTEST_DURATION ?= 60s
LOADTEST_USERS ?= 16

.PHONY: serve test installed test-fast typecheck lint lint-imports format generate clean appliance-venv loadtest haproxy \
	bench-sim bench-service bench-host report

# A fresh venv's pip is the one Python bundles (23.2 with 3.11): a current one resolves the test extras'
# 180 packages in a third of the CPU (about 70 -> 25 s here; the test install 2:07 -> 1:05), so each
# install takes it first.
PIP_FLOOR := pip>=25.1

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U '$(PIP_FLOOR)'
	$(PY) -m pip install -q -e .
	touch $@

# One pip run for the test install (it holds the run install): a second resolution costs CI about 25 s.
# --no-compile: byte-compiling every installed module (torch, transformers, lm-eval's pandas and
# pyarrow) took more than half of the install's CPU; Python compiles what the tests import as they do.
$(TEST_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U '$(PIP_FLOOR)'
	$(PY) -m pip install -q --no-compile -e '.[test]'
	touch $(RUN_STAMP) $@

serve: $(RUN_STAMP)
	$(VENV)/bin/wafer-gpt2 serve --host $(HOST) --port $(PORT)

generate: $(RUN_STAMP)
	$(VENV)/bin/wafer-gpt2 generate "The meaning of life is"

# Everything CI runs: lint, the type checker (mypy on wafer_gpt2/, csl_executor/ and tools/, pyproject's
# [tool.mypy]), the import contracts (layers, the CSL executor's independence, no cycles: pyproject's
# [tool.importlinter]), then every test, the slow ones included, on one pytest-xdist worker per core (the
# tests are single-threaded and CPU-bound; a worker that runs out of tests takes some queued for the
# other, so that a few long ones at the end do not leave a core idle). mypy (one thread, about half a
# minute without its cache) runs beside the tests, in the time their waits on servers and subprocesses
# leave a core idle; either failing fails the target.
test: installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m mypy & mypy=$$!; $(PY) -m pytest -n auto --dist worksteal; tests=$$?; wait $$mypy && exit $$tests

# Both environments and HAProxy, installed side by side: each pip run keeps one core busy, and the
# appliance's (about 30 s) then costs CI nothing.
installed:
	$(MAKE) --no-print-directory -j3 $(TEST_STAMP) $(APPLIANCE_STAMP) haproxy

# The inner loop: stops at the first failure and leaves out the tests marked slow (pyproject's markers).
test-fast: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n auto -x -m "not slow and not executor_full"

typecheck: $(TEST_STAMP)
	$(PY) -m mypy

lint: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

lint-imports: $(TEST_STAMP)
	$(VENV)/bin/lint-imports

format: $(TEST_STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

loadtest: installed
	$(PY) tools/loadtest/run.py --duration $(LOADTEST_DURATION) --users $(LOADTEST_USERS) --out out/loadtest

# The benchmarks and the performance report: sim, service and the report are tools run from the checkout
# (tools/, not in the wheel); host ships with the product (`wafer-gpt2 bench host`, the run install).
# Options go in ARGS, e.g. `make bench-host ARGS="--stand-in null --host-streams 64"`.
bench-sim: $(TEST_STAMP)
	$(PY) -m tools.bench sim $(ARGS)

bench-service: $(TEST_STAMP)
	$(PY) -m tools.bench service $(ARGS)

bench-host: $(RUN_STAMP)
	$(VENV)/bin/wafer-gpt2 bench host $(ARGS)

# The fast path (every figure modeled); `make report ARGS=--measure` adds the benchmarks measured here.
report: $(TEST_STAMP)
	$(PY) -m tools.report --out docs $(ARGS)

clean:
	rm -rf $(VENV) $(APPLIANCE_VENV) .pytest_cache .import_linter_cache build *.egg-info out

# tests/test_robust_replicas.py runs Debian's HAProxy in front of two servers: installed here when it is
# missing and we are root with apt-get; otherwise that test skips and says why.
haproxy:
	@command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy \
	  || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null 2>&1 \
	       && { apt-get install -y -q haproxy >/dev/null 2>&1 \
	            || { apt-get update -q >/dev/null && apt-get install -y -q haproxy >/dev/null; }; }; } \
	  || echo "haproxy is not installed (needs root and apt-get): tests/test_robust_replicas.py will skip"

appliance-venv: $(APPLIANCE_STAMP)

# Without python3.11 the environment is not built and tests/test_appliance_loopback.py skips, saying so.
$(APPLIANCE_STAMP): Makefile
	@if ! command -v $(PYTHON311) >/dev/null 2>&1; then \
	  echo "$(PYTHON311) is not installed: no $(APPLIANCE_VENV), tests/test_appliance_loopback.py will skip"; \
	else \
	  { test -x $(APPLIANCE_VENV)/bin/python || $(PYTHON311) -m venv $(APPLIANCE_VENV); } \
	  && $(APPLIANCE_VENV)/bin/pip install -q --no-compile cerebras-sdk==2.10.0 cerebras-appliance==2.10.0 'threadpoolctl>=3.1' \
	  && touch $@; \
	fi
