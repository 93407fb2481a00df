# Ridgeline: `make demo` runs the whole pipeline on the embedded default, `make test` runs the tests.
# Both set themselves up idempotently (system packages, eBPF prerequisites, virtualenv).
PY ?= python3
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo bench clean

setup:
	@bash scripts/setup.sh

test: setup
	@$(VENV)/bin/python -m pytest --run-slow $(PYTEST_ARGS)

test-fast: setup
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

demo: setup
	@$(VENV)/bin/ridgeline demo

bench: setup
	@$(VENV)/bin/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
