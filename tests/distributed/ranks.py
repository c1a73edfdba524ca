"""Run a function on N gloo ranks, each its own spawned process with one torch thread.

    run_ranks(fn, 2, *args) -> [fn(group, *args) on rank 0, on rank 1]

`fn` must be importable (a module-level function of a test module); its return value must pickle.
A rank that raises fails the call with that rank's traceback.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from tests.server_process import free_port


def _rank_main(rank: int, fn, size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch

    from blockserve.tensor_parallel.group import TensorParallelGroup

    torch.set_num_threads(1)
    group = TensorParallelGroup(f"tcp://127.0.0.1:{port}", rank, size)
    try:
        result = fn(group, *args)
    finally:
        group.close()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn, size: int, *args) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(fn, size, free_port(), out_dir, args), nprocs=size, join=True)
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(size)]
