"""What one layer stores per block (or per state slot), and how many blocks a request needs.

A spec describes a single layer. Layers with equal specs form a KV cache group that shares
one block table per request and one block pool (see `config.KVCacheGroup`).

    full / MLA     block = block_size tokens; a request of N tokens holds cdiv(N, block_size)
    sliding window block = block_size tokens; blocks wholly before the window are freed
    linear state   block = one state slot (conv + recurrent state); one per running request,
                   plus checkpoint slots (saved states) when prefix caching is on

Dtypes are names ("float32", "bfloat16", ...) so this package never needs torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int4_rotated": 1,  # the byte of its storage; kv_row_bytes counts two codes per byte
}


# Quantized K/V: each head vector of each token is stored in its block as `head_size` one-byte
# codes followed by its float16 scale (KV_SCALE_BYTES), x ~= code * scale; or, rotated 4-bit
# ("int4_rotated", uint8 bytes), as head_size / 2 bytes of packed 4-bit codes followed by a float16
# scale and a float16 minimum (attention/kv_quant.py).
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn", "int4_rotated")
KV_SCALE_BYTES = 2
INT4_SCALE_BYTES = 4  # scale and minimum, float16 each

# The engine's kv_cache_dtype choices: "auto" keeps each layer's own dtype (the model's); "fp8" is
# e4m3 (the stored dtype float8_e4m3fn); "int4" the rotated 4-bit form (stored as "int4_rotated").
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "int4")
_STORED_AS = {"fp8": "float8_e4m3fn", "int4": "int4_rotated"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def kv_row_bytes(dtype: str, head_size: int) -> int:
    """Bytes of one head vector of one token as stored: its elements, plus its scale when quantized
    (the rotated 4-bit form: two codes a byte, then its scale and minimum)."""
    if dtype == "int4_rotated":
        if head_size % 4:  # two codes a byte, and the float16 scale at an even byte of the row
            raise ValueError(f"kv_cache_dtype int4 packs two codes a byte: head_size {head_size} must be a "
                             f"multiple of 4")
        return head_size // 2 + INT4_SCALE_BYTES
    return head_size * dtype_bytes(dtype) + (KV_SCALE_BYTES if dtype in QUANTIZED_KV_DTYPES else 0)


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class FullAttentionSpec:
    """Keys and values of every token, `block_size` tokens per block. A quantized dtype
    (QUANTIZED_KV_DTYPES) keeps each head vector's scale beside its codes, inside the block."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float32"

    state_must_start_zeroed: ClassVar[bool] = False
    supports_prefix_caching: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        kv_row_bytes(self.dtype, self.head_size)  # a known dtype that can store this head size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V; codes and scales when quantized)."""
        return 2 * self.block_size * self.num_kv_heads * kv_row_bytes(self.dtype, self.head_size)

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request of `num_tokens` tokens ever holds at once."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Like full attention, but a token sees only the last `sliding_window` tokens (itself included)."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(sliding_window=self.sliding_window)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no token from `num_computed_tokens` on will ever attend to."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        # Computing a chunk of c tokens needs the window before it plus the chunk itself,
        # which may straddle one more block boundary than its length suggests.
        chunk = num_tokens if max_chunk_tokens is None else min(num_tokens, max_chunk_tokens)
        in_window = cdiv(self.sliding_window - 1 + chunk, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), in_window)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one compressed latent (kv_lora_rank) plus the rope key per token."""

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str = "float32"

    state_must_start_zeroed: ClassVar[bool] = False
    supports_prefix_caching: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _require_positive(
            block_size=self.block_size, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )
        dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes(self.dtype)

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class LinearStateSpec:
    """A recurrent layer's state (e.g. a conv state and an SSM / delta-rule state), one slot per request.

    `shapes[i]` and `dtypes[i]` describe the i-th state tensor of one slot. A new request's state
    must start at zero unless `starts_zeroed` is False (a layer that overwrites its whole state
    before reading it). `chunk_size` is the kernel's chunk length: its state can be captured
    exactly (and resumed bit-for-bit) only at positions that are multiples of it.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    starts_zeroed: bool = True
    chunk_size: int = 1

    block_size: ClassVar[int] = 0  # a slot holds a whole sequence's state, not a fixed token count
    supports_prefix_caching: ClassVar[bool] = True  # through state checkpoints (kv/checkpoint_pool.py)

    def __post_init__(self) -> None:
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError("a linear state needs one dtype per state shape, and at least one shape")
        for shape in self.shapes:
            if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(f"state shapes must be tuples of positive integers, got {shape!r}")
        for dtype in self.dtypes:
            dtype_bytes(dtype)
        _require_positive(chunk_size=self.chunk_size)

    @property
    def state_must_start_zeroed(self) -> bool:
        return self.starts_zeroed

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        return 1 if num_tokens > 0 else 0


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | LinearStateSpec


def zero_new_blocks(spec: KVCacheSpec, backend_reads_unwritten_slots: bool) -> bool:
    """C1: must a group's newly allocated blocks be zeroed before any kernel reads them?

    Derived from what the backend declares and what the spec declares, never from a list of
    layer types. Called once per group at start-up; the result lives in `KVCacheGroup`.
    """
    return backend_reads_unwritten_slots or spec.state_must_start_zeroed


def with_kv_cache_dtype(spec, kv_cache_dtype: str):
    """The spec with its K/V stored as `kv_cache_dtype` (full and sliding-window attention; MLA
    latents and recurrent states keep the model's dtype). "auto" returns the spec unchanged.
    A quantized dtype is refused for MLA latents, which have no quantized form."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}")
    stored = _STORED_AS.get(kv_cache_dtype, kv_cache_dtype)
    if stored in QUANTIZED_KV_DTYPES and isinstance(spec, MLASpec):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not built for MLA layers' latent cache; "
                         f"use auto, float16 or bfloat16 for this model")
    if kv_cache_dtype == "auto" or not isinstance(spec, FullAttentionSpec):
        return spec
    return dataclasses.replace(spec, dtype=stored)
