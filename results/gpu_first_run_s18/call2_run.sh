# call 2 of session 18: diagnostics, then the check without flex
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dsite build/gpu_wheels/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=/tmp/dsite PYTHONUNBUFFERED=1
start=$SECONDS
for v in "llama flex graphs nopoison bfloat16" "gemma3 flex graphs poison bfloat16" "llama flex eager nopoison bfloat16 big" \
         "llama triton eager nopoison float32" "llama triton graphs nopoison float32" "llama triton graphs nopoison float32 big" \
         "llama exact eager nopoison float32"; do
    (( SECONDS - start > 170 )) && { echo "SKIPPED engine $v"; continue; }
    echo "== $v at $((SECONDS - start)) s"
    CUDA_LAUNCH_BLOCKING=1 timeout 45 python3 .diag/diag.py engine $v 2>&1 | grep -v "DEBUG\|Writing model\|^\s*$" | tail -25
done
timeout 40 python3 .diag/diag.py triton 2>&1 | grep -v "DEBUG" | tail -20
echo "diag took $((SECONDS - start)) s"
