"""A probe, not engine code: the bundled SmolLM2 decoding R requests for S steps (after their
prefill), the median step printed; with count_omp_regions.c preloaded, two runs that differ in S
give a step's OpenMP regions.

    R=1 S=201 SAMPLED=1 LD_PRELOAD=/tmp/count_omp_regions.so OMP_WAIT_POLICY=PASSIVE \
        .venv/bin/python benchmarks/probes/decode_steps.py
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_glue import decoding_engine  # noqa: E402

from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402

running, steps = int(os.environ.get("R", "1")), int(os.environ.get("S", "60"))
sampling = dict(temperature=0.8, top_k=50, top_p=0.9) if os.environ.get("SAMPLED") else None
torch.set_num_threads(int(os.environ.get("T", "2")))
llm = decoding_engine(load_model(None, BACKENDS["exact"]), running, steps, "auto", sampling, adaptive_threads=False)
walls = []
for _ in range(steps):
    start = time.perf_counter()
    llm.engine.step()
    walls.append(time.perf_counter() - start)
print(f"{running} running, {steps} steps{', sampled' if sampling else ''}: median {1e3 * statistics.median(walls):.2f} ms")
