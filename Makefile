# Ridgeline: `make demo` runs the whole pipeline on the embedded default, `make test` runs the tests.
# Both set themselves up idempotently (system packages, eBPF prerequisites, virtualenv).
PY ?= python3
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup lint lint-fix test test-fast demo bench clean

setup:
	@bash scripts/setup.sh

# Files run on PYTEST_WORKERS processes (pytest-xdist; a file stays on one worker, so its
# module fixtures are built once). Most of the suite waits on subprocesses and sockets, so
# three workers fit two cores; PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 3

# The linter runs first: a finding fails in seconds, before the 40-minute suite
# (configuration: [tool.ruff] in pyproject.toml).
lint: setup
	@$(VENV)/bin/ruff check .

# Safe fixes only (import order, unused imports). After a merge, run this rather than
# resolving import blocks by hand, then `make lint`.
lint-fix: setup
	@$(VENV)/bin/ruff check --fix .

test: setup lint
	@$(VENV)/bin/python -m pytest --run-slow -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: setup
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

demo: setup
	@$(VENV)/bin/ridgeline demo

bench: setup
	@$(VENV)/bin/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
