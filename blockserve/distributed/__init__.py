"""Tensor parallelism on torch.distributed (gloo on CPU): the process group (group.py), the sharded
layers the model families build (parallel_layers.py), rank 0's executor in the engine process
(executor.py) and the other ranks' loop (worker.py)."""
