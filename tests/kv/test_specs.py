"""Specs: page sizes, the most blocks a request holds, validation, and the C1 zero flag."""

import pytest

from blockserve.kv import FullAttentionSpec, LinearStateSpec, MLASpec, SlidingWindowSpec, zero_new_blocks
from blockserve.kv.specs import with_kv_cache_dtype
from tests.kv.conftest import full, mla, sliding, state


def test_page_sizes():
    assert FullAttentionSpec(16, 8, 128, "bfloat16").page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert SlidingWindowSpec(16, 8, 128, "float32", sliding_window=4096).page_size_bytes == 2 * 16 * 8 * 128 * 4
    assert MLASpec(64, 512, 64, "bfloat16").page_size_bytes == 64 * (512 + 64) * 2
    assert MLASpec(64, 512, 64, "float8_e4m3fn").page_size_bytes == 64 * (512 + 64 + 4)  # codes, two scales
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


def test_keys_and_values_in_their_own_dtypes():
    """k8v4 (and k_cache_dtype / v_cache_dtype): int8 keys (64 codes + scale) with rotated 4-bit values
    (32 bytes + scale and minimum) per head vector; a pair the kernels do not read is refused naming both."""
    base = FullAttentionSpec(16, 3, 64)
    split = with_kv_cache_dtype(base, "k8v4")
    assert (split.dtype, split.v_dtype, split.dtype_name) == ("int8", "int4_rotated", "int8 keys / int4 values")
    assert split.page_size_bytes == 16 * 3 * (66 + 36) and split.is_quantized
    assert with_kv_cache_dtype(base, "int4", k_cache_dtype="int8") == split
    assert with_kv_cache_dtype(base, "fp8", v_cache_dtype="int4").v_dtype == "int4_rotated"
    assert with_kv_cache_dtype(base, "k8v4", v_cache_dtype="int8") == with_kv_cache_dtype(base, "int8")
    assert with_kv_cache_dtype(base, "int8", k_cache_dtype="int8").v_dtype is None  # one dtype: one tensor
    assert with_kv_cache_dtype(SlidingWindowSpec(16, 3, 64, sliding_window=8), "k8v4").sliding_window == 8
    with pytest.raises(ValueError, match="k_cache_dtype 'int4' with v_cache_dtype 'int8' is not built"):
        with_kv_cache_dtype(base, "int4", v_cache_dtype="int8")
    with pytest.raises(ValueError, match="k_cache_dtype 'float16' with v_cache_dtype 'int4' is not built"):
        with_kv_cache_dtype(base, "auto", k_cache_dtype="float16", v_cache_dtype="int4")
    with pytest.raises(ValueError, match="unknown v_cache_dtype 'k8v4'"):
        with_kv_cache_dtype(base, "auto", v_cache_dtype="k8v4")
    with pytest.raises(ValueError, match="K as 'int8' and V as 'int4', but an MLA layer's latent row is its keys"):
        with_kv_cache_dtype(MLASpec(16, 32, 8), "k8v4")
