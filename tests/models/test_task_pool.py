"""csrc/task_pool.h, through a kernel that splits its rows over it (gguf_matmul_int8): the tasks are cut
into one lane per thread, each thread drains its own lane and then the others'. Every task must run
once whatever the thread count, with lanes of unequal length, with more threads than tasks and more
threads than cores (workers descheduled, their lanes taken by the others), and each output keeps
its bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_gguf_block_linear import BUILDS, random_blocks
from tests.threads import torch_threads

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(any(ops is None or not ops.simd_lanes() for ops in BUILDS.values()),
                                 reason="the block kernels need native kernels built with AVX-512 or AVX2")]


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_task_runs_once_at_any_thread_count(build):
    """37 rows of 16384 values at one row of x: tasks of 4 rows (the kernel's 64K multiply-adds), 10 tasks
    at 3 threads (lanes of 3, 3 and 4), 10 at 4 (2, 3, 2, 3), 13 at 7 (1 and 2) and 37 one-row tasks at 37
    threads. Every output stays alive, so no call's output reuses an earlier one's memory: a task that no
    thread ran leaves whatever its fresh memory held."""
    ops, rng = BUILDS[build], np.random.default_rng(11)
    raw = torch.from_numpy(random_blocks("Q4_K", 37, 16384, rng))
    x = torch.randn(1, 16384, generator=torch.Generator().manual_seed(11))
    want = ops.gguf_matmul_int8(x, raw, "Q4_K")
    assert want.isfinite().all()
    kept = [want]
    for threads in (2, 3, 4, 7, 37, 2):
        with torch_threads(threads):
            for _ in range(3):
                kept.append(ops.gguf_matmul_int8(x, raw, "Q4_K"))
                assert torch.equal(kept[-1], want), f"{threads} threads"
