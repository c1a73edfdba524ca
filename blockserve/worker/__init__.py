"""The worker: KV tensors, input preparation, the model runner and the sampler (uses torch)."""
