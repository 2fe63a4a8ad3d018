# Two commands on a fresh machine: `make demo` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-all test-portable fuzz lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zinfjax train examples/demo.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports  # the layering of docs/design.md, as contracts in pyproject.toml
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=15 -m "not wide and not soak"  # two workers: one per core; soak: make test-all
	$(PORTABLE) -m "numeric and not wide and not soak" $(PORTABLE_CORE)

# Every numeric test again (a tolerance, or bits against another computation), under a second kernel path: XLA's
# code capped at SSE4.2 sums in another order than the AVX-512 or AVX2 code it makes on these machines, as another
# CPU would (docs/engine.md, "What may differ between machines"). That code cannot convert fp16 (XLA's JIT fails to
# find the conversion without F16C): fp16 runs on the default path alone.
PORTABLE := XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 $(VENV)/bin/pytest -q -n 2 --dist loadfile -k "not fp16"
# make test's short form of it: each kind of bound once (the planted defects, the float64-relative fp32 rule on the
# engine, the stages and a frozen half, bf16's derived bounds, the products' bounds); test-portable runs them all.
PORTABLE_CORE := tests/test_tolerances.py tests/engine/test_exact.py tests/engine/test_stages.py \
	tests/engine/test_mixed_precision.py tests/models/test_products.py tests/engine/test_frozen_half.py

test-portable: $(STAMP)
	$(PORTABLE) -m "numeric and not wide and not soak"

test-all: $(STAMP)  # the wide corners of the test matrices too
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=15
	$(PORTABLE) -m "numeric and not soak"

fuzz: $(STAMP)  # the property tests with a fresh draw each run (make test draws the same examples every time)
	HYPOTHESIS_PROFILE=explore $(VENV)/bin/pytest -q tests/test_fuzz.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf runs .pytest_cache .hypothesis
