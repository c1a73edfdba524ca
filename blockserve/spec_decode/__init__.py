"""Speculative decoding: proposers guess the next tokens of a request, the target model scores
them all in one step, and the tokens it would have produced anyway are kept (docs/speculative.md).

Torch-free: the scheduler runs the proposers; the worker verifies with the ordinary sampler."""
