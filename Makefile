# One virtualenv, pinned dependencies. `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test bench-kv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

test: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest

bench-kv: install
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/kv_core.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
