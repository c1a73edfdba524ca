"""Specs: page sizes, the most blocks a request holds, validation, and the C1 zero flag."""

import pytest

from blockserve.kv import FullAttentionSpec, LinearStateSpec, MLASpec, SlidingWindowSpec, zero_new_blocks
from tests.kv.conftest import full, mla, sliding, state


def test_page_sizes():
    assert FullAttentionSpec(16, 8, 128, "bfloat16").page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert SlidingWindowSpec(16, 8, 128, "float32", sliding_window=4096).page_size_bytes == 2 * 16 * 8 * 128 * 4
    assert MLASpec(64, 512, 64, "float8_e4m3fn").page_size_bytes == 64 * (512 + 64) * 1
    spec = LinearStateSpec(shapes=((4, 3), (2, 5, 7)), dtypes=("float16", "float32"))
    assert spec.page_size_bytes == 4 * 3 * 2 + 2 * 5 * 7 * 4


@pytest.mark.parametrize("spec", [full(4), mla(4)])
def test_full_and_mla_hold_every_block(spec):
    assert [spec.max_blocks_held(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert spec.max_blocks_held(100, max_chunk_tokens=1) == 25


def test_sliding_window_holds_the_window_plus_the_chunk():
    spec = sliding(block_size=4, window=6)
    # Short requests, and any request prefilled in one chunk, hold every block.
    assert spec.max_blocks_held(5) == 2
    assert spec.max_blocks_held(1000) == 250
    # Decoding token by token: the window straddles at most cdiv(window, block_size) + 1 blocks.
    assert spec.max_blocks_held(1000, max_chunk_tokens=1) == 3
    # A chunk of c tokens needs the window before it as well: cdiv(window - 1 + c, bs) + 1.
    assert spec.max_blocks_held(1000, max_chunk_tokens=8) == 5
    assert spec.max_blocks_held(6, max_chunk_tokens=1) == 2


def test_linear_state_holds_one_slot_whatever_the_length():
    spec = state()
    assert [spec.max_blocks_held(n) for n in (0, 1, 10**6)] == [0, 1, 1]
    assert spec.block_size == 0 and spec.supports_prefix_caching  # through checkpoints


@pytest.mark.parametrize(
    "make",
    [
        lambda: FullAttentionSpec(0, 1, 8),
        lambda: FullAttentionSpec(16, -1, 8),
        lambda: FullAttentionSpec(16, 1, 8.0),
        lambda: MLASpec(16, 0, 64),
        lambda: SlidingWindowSpec(16, 1, 8),  # the window is required
        lambda: SlidingWindowSpec(16, 1, 8, sliding_window=-4),
        lambda: LinearStateSpec(shapes=(), dtypes=()),
        lambda: LinearStateSpec(shapes=((4,),), dtypes=("float32", "float32")),
        lambda: LinearStateSpec(shapes=((4, 0),), dtypes=("float32",)),
        lambda: LinearStateSpec(shapes=((),), dtypes=("float32",)),
    ],
)
def test_invalid_specs_are_refused(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: FullAttentionSpec(16, 1, 8, "float64"),
        lambda: SlidingWindowSpec(16, 1, 8, "fp16", sliding_window=4),
        lambda: MLASpec(16, 512, 64, "torch.bfloat16"),
        lambda: LinearStateSpec(shapes=((4,),), dtypes=("complex64",)),
    ],
)
def test_unknown_dtypes_are_refused_with_the_valid_names(make):
    with pytest.raises(ValueError, match="unknown KV dtype.*bfloat16"):
        make()


def test_specs_are_frozen_and_hashable():
    spec = sliding()
    with pytest.raises(AttributeError):
        spec.block_size = 8
    assert len({full(), full(), sliding(), mla(), state(), state()}) == 4
    assert full() != FullAttentionSpec(4, 1, 8, "float16") and sliding() != full()


@pytest.mark.parametrize(
    ("spec", "backend_reads_unwritten", "expected"),
    [
        (full(), False, False),
        (full(), True, True),
        (sliding(), False, False),
        (sliding(), True, True),
        (mla(), False, False),
        (mla(), True, True),
        (state(starts_zeroed=True), False, True),
        (state(starts_zeroed=True), True, True),
        (state(starts_zeroed=False), False, False),
        (state(starts_zeroed=False), True, True),
    ],
)
def test_zero_new_blocks_derivation(spec, backend_reads_unwritten, expected):
    """C1: attention groups follow the backend's declaration; a state starts at zero unless it says not."""
    assert zero_new_blocks(spec, backend_reads_unwritten) is expected
