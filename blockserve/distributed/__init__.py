"""Tensor parallelism's processes: rank 0's executor in the engine process (executor.py), the
other ranks' loop (worker.py) and how the engine starts them (rank_process.py), over the building
blocks in tensor_parallel/."""
