"""The paged attention backends the model and engine tests run over: the CPU ones. `flex`
(FlexAttention: eager and slow on CPU, ~3 minutes over these tests) is covered by its own parity,
poison and engine tests (tests/attention/test_flex_attention.py, the MLA kernel tests) and joins
these with BLOCKSERVE_TEST_FLEX=1. `triton` (its kernel in Triton's interpreter) likewise has its own
(tests/attention/test_triton_attention.py, the MLA kernel tests, the CUDA graph replays)."""

import os

SUITE_BACKENDS = ["exact", "whole_block"] + (["flex"] if os.environ.get("BLOCKSERVE_TEST_FLEX") == "1" else [])
