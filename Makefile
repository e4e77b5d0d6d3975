# Two entry points do all set-up from nothing:
#   make quickstart   # federated LoRA fine-tuning of SmolLM2 on the offline instruction suite
#   make test         # the test suite
.PHONY: setup setup-test quickstart test test-fast lint bench mutate

# The quickstart's set-up, then the tests' on top of it (dev tools, Fashion-MNIST, Chromium).
STAMP := .venv/.fedfm-setup
TEST_STAMP := .venv/.fedfm-setup-test
$(STAMP): pyproject.toml requirements-assets.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	bash scripts/setup.sh --test
	touch $(TEST_STAMP)

setup: $(STAMP)

setup-test: $(TEST_STAMP)

quickstart: $(STAMP)
	.venv/bin/fedfm run quickstart --overwrite

# Static checks first (ruff with docstring rules for core/ and algorithms/, mypy on all of
# src/fedfm; settings in pyproject.toml), then the tests.
# One worker per core (at most 4), each test file on one worker (its module fixtures built
# once); tests/conftest.py splits the cores' threads between the workers.
test: $(TEST_STAMP) lint
	.venv/bin/python -m pytest -q -ra -n auto --maxprocesses 4 --dist loadfile

test-fast: $(TEST_STAMP)
	.venv/bin/python -m pytest -q -m "not slow"

lint: $(TEST_STAMP)
	.venv/bin/ruff check src tests benchmarks
	.venv/bin/python -m mypy

bench: $(TEST_STAMP)
	.venv/bin/python benchmarks/overhead.py
	.venv/bin/python benchmarks/memory.py
	.venv/bin/python benchmarks/throughput.py
	.venv/bin/python benchmarks/generate.py
	.venv/bin/python benchmarks/dp_overhead.py

# Mutation testing of the numerical core (mutmut; files and tests in [tool.mutmut] of
# pyproject.toml). Not part of `make test`: too slow for 2 cores. Re-measure when those files
# change and update docs/testing.md. MUTANTS narrows it, e.g. MUTANTS='fedfm.core.optim*'.
# One thread: torch's OpenMP pool does not survive the fork of each mutant's test run (the
# forked tests spin until their CPU limit and would count as timeouts).
mutate: $(TEST_STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/mutmut run --max-children 2 $(MUTANTS)
	.venv/bin/mutmut results
