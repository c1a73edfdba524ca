"""Tensor-parallel building blocks on torch.distributed (gloo on CPU): the rank group (group.py)
and the sharded layers the model families build (layers.py). distributed/ starts the ranks."""
