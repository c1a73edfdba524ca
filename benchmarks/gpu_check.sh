#!/usr/bin/env bash
# The GPU check: proves blockserve's CUDA path on a machine with an NVIDIA GPU, where CI cannot.
# It runs blockserve/bench/gpu_check.py on CUDA (greedy parity per model family against transformers in
# bfloat16, the C1 poison proof per attention backend, the attention kernels' timings, and decode
# throughput against transformers and the HBM bound), then, with `pytest`, the test suite's tests
# marked `gpu` (CUDA graphs against eager, the engine on CUDA against the CPU).
#
#   bash benchmarks/gpu_check.sh pack    # where there is network: the few pure-Python (and abi3) wheels
#                                        # `import blockserve` needs beyond a CUDA image's torch, triton and
#                                        # transformers, into build/gpu_wheels (~4 MB; no torch)
#   bash benchmarks/gpu_check.sh [ARGS]  # on the GPU machine (no network needed): installs those wheels and
#                                        # blockserve into a scratch site directory, then runs the check
#                                        # (~8 minutes; ARGS go to the check, e.g. --sections parity)
#   bash benchmarks/gpu_check.sh pytest  # on the GPU machine: the `gpu` tests (~2 minutes)
#   bash benchmarks/gpu_check.sh all     # both, the check's budget shortened to 320 s (under 9 minutes)
#
# It writes gpu_check.json (every section's figures and verdicts), gpu_check.txt (the short report),
# parts.log (the end of each part's output) and, with `pytest`, cuda_pytest.txt into $RESULTS
# (default results/gpu_check). The machine's python3 keeps its own torch, triton and transformers.
# Exit status: 0 when parity and poison pass (and the gpu tests, with `pytest`).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
# What `import blockserve` needs beyond the GPU image's packages (pinned as in pyproject.toml).
CARRIED="gguf==0.19.0 llguidance==1.9.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"

if [[ "${1:-}" == pack ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $CARRIED
    du -sh "$WHEELS"
    exit 0
fi

if [[ "${1:-}" == all ]]; then
    shift
    rc=0
    GPU_CHECK_TIMEOUT_S=350 bash "$SELF" --budget-s 320 "$@" || rc=$?
    GPU_PYTEST_TIMEOUT_S=150 bash "$SELF" pytest || rc=$((rc ? rc : $?))
    exit "$rc"
fi

ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: run 'bash benchmarks/gpu_check.sh pack' first (with network) and carry $WHEELS" >&2; exit 2; }
SITE=$(mktemp -d /tmp/blockserve-site.XXXX)
trap 'rm -rf "$SITE"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$SITE" .
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-results/gpu_check}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [[ "${1:-}" == pytest ]]; then
    mkdir -p "$RESULTS"
    timeout "${GPU_PYTEST_TIMEOUT_S:-170}" python3 -m pytest --cuda -m gpu -p no:cacheprovider -v -rA --log-level=WARNING \
        tests/worker/test_cuda_graphs.py tests/engine/test_device.py tests/worker/test_step_tables.py \
        tests/attention/test_flex_attention.py 2>&1 | tee "$RESULTS/cuda_pytest.txt"
    exit "${PIPESTATUS[0]}"
fi
# The check sizes itself to ~450 s (--budget-s); the hard stop keeps it inside 8 minutes, and the
# sections finished by then are already written. Less time: --budget-s and GPU_CHECK_TIMEOUT_S.
timeout "${GPU_CHECK_TIMEOUT_S:-475}" python3 -m blockserve.bench.gpu_check --device cuda --results "$RESULTS" "$@"
