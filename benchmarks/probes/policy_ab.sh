#!/bin/bash
# A probe: alternating A/B of the OpenMP wait policy for blockserve's offline commands (native ISA, 2 threads).
cd "$(dirname "$0")/../.."
lscpu | grep -E "Model name|family" ; grep -o -w -E "avx2|avx512f|avx_vnni|avx512_vnni" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for r in 1 2 3; do
  for pol in spin PASSIVE; do
    if [ $pol = spin ]; then env="GOMP_SPINCOUNT=100000"; else env="OMP_WAIT_POLICY=PASSIVE"; fi
    echo "== round $r $pol: throughput b64"
    env $env .venv/bin/blockserve bench throughput --random-input-len 112 --num-prompts 64 --max-tokens 128 --num-threads 2 --no-roofline --no-progress 2>&1 | grep -E "generated tokens/s|others"
    echo "== round $r $pol: latency b1"
    env $env .venv/bin/blockserve bench latency --batch-sizes 1 --num-threads 2 --no-roofline --no-progress 2>&1 | grep -iE "itl|inter-token|batch 1|others" | head -4
  done
done
