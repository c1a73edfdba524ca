"""Tensor parallelism's processes: rank 0's executor in the engine process (executor.py) and the
other ranks' loop (worker.py), over the building blocks in tensor_parallel/."""
