# The two commands in the README are the contract: `make demo` and `make test` work on a
# fresh machine with nothing but python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-all test-profile test-floor lint docs bench bench-gpu \
	bench-gpu-wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python examples/demo.py

# The default suite (619 s on 2 cores from a fresh clone; less once .cache/jax is warm);
# `make test-slow` runs the rest of the parameter grids and the runnable docs pages (tests
# marked `slow`), `make test-all` both. CI runs both. JOBS test processes run side by
# side (pytest-xdist); JOBS=0 runs them in this process. Every run shares the persistent
# compilation cache in .cache/jax (tests/_compile_cache.py; `make clean` removes it): a program
# compiled once loads in every later run. The line "XLA: ..." at the end of a run gives its
# compilations and the cache's hit rate.
JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS)

test: $(VENV)/.installed-test
	$(PYTEST) -m "not slow"

test-slow: $(VENV)/.installed-test
	$(PYTEST) -m slow

test-all: $(VENV)/.installed-test
	$(PYTEST)

# Where a suite's time goes: per test file and for the slowest tests, the wall time and how much
# of it is building XLA programs (tests/profile_report.py). MARK picks the suite ("not slow",
# "slow" or "" for all); the records stay in PROFILE_DIR.
MARK ?= not slow
PROFILE_DIR ?= .cache/profile

test-profile: $(VENV)/.installed-test
	rm -rf $(PROFILE_DIR)
	$(PYTEST) -m "$(MARK)" --suite-profile=$(PROFILE_DIR)
	$(BIN)/python -m tests.profile_report $(PROFILE_DIR)

# The oldest versions of the dependencies pyproject.toml allows (its lower bounds, pinned in
# .ci/floor-constraints.txt), in their own environment, and a smoke subset of the suite
# (.ci/floor-tests.txt: the kernels one device and context parallel, the layer, the attention).
FLOOR_VENV ?= .venv-floor

$(FLOOR_VENV)/.installed: pyproject.toml .ci/floor-constraints.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt \
		-r .ci/floor-constraints.txt -e ".[test]"
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider @.ci/floor-tests.txt

# ruff (lint and format) over everything; pyright over the package and the tests (0 errors).
lint: $(VENV)/.installed-dev $(VENV)/.installed-test
	$(BIN)/ruff check deltanet_cp tests benchmarks examples
	$(BIN)/ruff format --check deltanet_cp tests benchmarks examples
	$(BIN)/pyright

# The documentation site, into site/. Strict: any warning (a broken link, a cross-reference
# to an undocumented name) fails the build.
docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict --site-dir site

# Benchmarks run in their own environment with the peers we compare against (torch, transformers,
# MaxText, jax-linear-attention); they are never dependencies of the library. pip picks the local
# CPU wheel by the exact pin. The MaxText and jax-linear-attention wheels declare Python >= 3.12
# (MaxText also pulls flax and much more): both are downloaded for 3.12 and installed without
# their dependencies. benchmarks/_maxtext.py reads MaxText's kernel file without importing its
# package; benchmarks/_jla.py imports only jla.ops.chunked and jla.distributed.context_parallel.
BENCH_VENV ?= .venv-bench
BENCH := $(BENCH_VENV)/bin
MAXTEXT ?= maxtext==0.2.5
JLA ?= jax-linear-attention==0.1.0

$(BENCH_VENV)/.installed: pyproject.toml Makefile
	test -x $(BENCH)/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH)/python -m pip install --quiet "torch==2.13.0" transformers -e .
	rm -rf $(BENCH_VENV)/wheels
	$(BENCH)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		-d $(BENCH_VENV)/wheels "$(MAXTEXT)" "$(JLA)"
	$(BENCH)/python -m pip install --quiet --no-deps --ignore-requires-python $(BENCH_VENV)/wheels/*.whl
	touch $@

# Peer comparisons run one implementation per process, paired (benchmarks/_harness.py); depth.py
# compiles and reads the programs without running them.
bench: $(BENCH_VENV)/.installed
	$(BENCH)/python benchmarks/peers.py
	$(BENCH)/python benchmarks/depth.py
	$(BENCH)/python benchmarks/cp_cost.py
	$(BENCH)/python benchmarks/attention_balance.py

# On a CUDA machine with jax, torch, triton and transformers and no network: the sequential depth
# on the GPU, then ours vs FLA's Triton kernel vs MaxText, one process each, paired
# (benchmarks/accelerator.py; ends within 8 minutes). `make bench-gpu-wheels`, run where there is
# a network, fills $(WHEELS) with what that machine lacks; carry it over.
# `python benchmarks/accelerator.py --quick` runs the same script on a CPU (tiny shapes, no FLA).
GPU_PYTHON ?= python3
WHEELS ?= wheels

bench-gpu:
	$(GPU_PYTHON) benchmarks/accelerator.py --wheels $(WHEELS)

bench-gpu-wheels:
	$(PYTHON) -m pip download --no-deps -d $(WHEELS) fla-core einops equinox jaxtyping wadler-lindig
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d $(WHEELS) \
		"$(MAXTEXT)" "$(JLA)"

clean:
	rm -rf $(VENV) $(FLOOR_VENV) site .pytest_cache .cache
