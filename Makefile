# Two entry points: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILD_DEPS := scikit-build-core nanobind jax==0.10.2 jaxlib==0.10.2
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*)

.PHONY: demo test lint bench bench-large docs clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_DEPS)
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pz_sparsecore shakespeare --report reports/shakespeare

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) benchmarks/preprocess.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/train_step.py

# Needs about 12 GiB of free memory.
bench-large: $(STAMP)
	$(PY) benchmarks/large_table.py

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf build $(VENV)
