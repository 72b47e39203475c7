# Set-up is shared by every target: a .venv with torch==2.13.0 installed *before* the
# project, so pyproject's torch range is already satisfied and pip never pulls a
# multi-GB CUDA build. An existing torch in the venv is kept.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.psring-installed
TORCH ?= torch==2.13.0

.PHONY: setup test lint compare bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e '.[test]'
	touch $(STAMP)

# Two pytest runs: every test but the emulated clusters' two at a time (most of a
# test's time is one core's: an interpreter starting, torch importing, a run waiting
# out a deadline), then those that time what crosses emulated links, one at a time
# (tests/conftest.py: SERIAL_FOLDERS, tests/emulation: only that folder is collected
# again). Plain `pytest` runs them all one at a time.
# First the sources are compiled once: with PYTHONDONTWRITEBYTECODE set (as on this
# project's machines) every process of every test would compile psring's modules anew.
test: $(STAMP)
	$(BIN)/python -m compileall -q psring workers servers tests examples > /dev/null
	$(BIN)/pytest -n 2 --dist loadgroup -m "not serial"
	$(BIN)/pytest -m serial tests/emulation

# ruff's rules are in pyproject.toml ([tool.ruff]); .ci/run runs this before the tests
lint: $(STAMP)
	$(BIN)/ruff check .

compare: $(STAMP)
	$(BIN)/psring compare

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_foundation.py
	$(BIN)/python benchmarks/bench_ps.py
	$(BIN)/python benchmarks/bench_links.py
	$(BIN)/python benchmarks/bench_runs.py

clean:
	rm -rf runs .pytest_cache build *.egg-info
