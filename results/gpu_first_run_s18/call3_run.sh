cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dsite build/gpu_wheels/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=/tmp/dsite PYTHONUNBUFFERED=1
start=$SECONDS
echo "== bisect"; timeout 75 python3 .diag/bisect.py 2>&1 | grep -v "DEBUG\|Writing model\|^\s*$" | tail -60 | cut -c1-600
echo "== gemma3 triton graphs poison at $((SECONDS - start)) s"
CUDA_LAUNCH_BLOCKING=1 timeout 40 python3 .diag/diag.py engine gemma3 triton graphs poison bfloat16 2>&1 | grep -v "DEBUG\|Writing model\|^\s*$" | head -60 | cut -c1-400
echo "== gemma3 flex graphs poison at $((SECONDS - start)) s"
CUDA_LAUNCH_BLOCKING=1 timeout 80 python3 .diag/diag.py engine gemma3 flex graphs poison bfloat16 2>&1 | grep -v "DEBUG\|Writing model\|^\s*$" | head -60 | cut -c1-400
echo "done at $((SECONDS - start)) s"
