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
# MLA latents take the one-byte forms; each row's two parts (latent, rope key) keep their own scale.
MLA_QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")
MLA_SCALES_BYTES = 2 * KV_SCALE_BYTES

# The engine's kv_cache_dtype choices: "auto" keeps each layer's own dtype (the model's); "fp8" is
# e4m3 (the stored dtype float8_e4m3fn); "int4" the rotated 4-bit form (stored as "int4_rotated");
# "k8v4" int8 keys with rotated 4-bit values (K_V_PRESETS). k_cache_dtype / v_cache_dtype take
# KV_SIDE_DTYPES and override one side.
KV_SIDE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "int4")
K_V_PRESETS = {"k8v4": ("int8", "int4")}
KV_CACHE_DTYPES = (*KV_SIDE_DTYPES, *K_V_PRESETS)
_STORED_AS = {"fp8": "float8_e4m3fn", "int4": "int4_rotated"}
_NAMED_AS = {stored: name for name, stored in _STORED_AS.items()}

# K and V stored in different dtypes: one-byte keys (the scores' precision matters most) with rotated
# 4-bit values. Any other split is refused: the decode kernel reads these pairs only.
SPLIT_KV_DTYPES = (("int8", "int4_rotated"), ("float8_e4m3fn", "int4_rotated"))


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


def _require_split_pair(k_stored: str, v_stored: str) -> None:
    if (k_stored, v_stored) not in SPLIT_KV_DTYPES:
        pairs = ", ".join(f"{kv_dtype_name(k)} keys with {kv_dtype_name(v)} values" for k, v in SPLIT_KV_DTYPES)
        raise ValueError(f"k_cache_dtype {kv_dtype_name(k_stored)!r} with v_cache_dtype {kv_dtype_name(v_stored)!r} "
                         f"is not built; K and V may differ only as {pairs}")


def kv_dtype_name(stored: str) -> str:
    """The kv_cache_dtype name of a stored dtype ("float8_e4m3fn" is "fp8", "int4_rotated" "int4")."""
    return _NAMED_AS.get(stored, stored)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Keys and values of every token, `block_size` tokens per block. A quantized dtype
    (QUANTIZED_KV_DTYPES) keeps each head vector's scale beside its codes, inside the block.
    `dtype` stores both K and V unless `v_dtype` names the values' own (a SPLIT_KV_DTYPES pair)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float32"
    v_dtype: str | None = None  # None: the values share `dtype`

    state_must_start_zeroed: ClassVar[bool] = False
    supports_prefix_caching: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        kv_row_bytes(self.dtype, self.head_size)  # a known dtype that can store this head size
        if self.v_dtype is not None:
            if self.v_dtype == self.dtype:
                raise ValueError(f"v_dtype {self.v_dtype!r} equals dtype: leave it None")
            _require_split_pair(self.dtype, self.v_dtype)
            kv_row_bytes(self.v_dtype, self.head_size)

    @property
    def k_dtype(self) -> str:
        return self.dtype

    @property
    def value_dtype(self) -> str:
        return self.dtype if self.v_dtype is None else self.v_dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V; codes and scales when quantized)."""
        rows = kv_row_bytes(self.dtype, self.head_size) + kv_row_bytes(self.value_dtype, self.head_size)
        return self.block_size * self.num_kv_heads * rows

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES or self.value_dtype in QUANTIZED_KV_DTYPES

    @property
    def dtype_name(self) -> str:
        """The K/V storage as kv_cache_dtype names: "int8", or "int8 keys / int4 values" when split."""
        if self.v_dtype is None:
            return kv_dtype_name(self.dtype)
        return f"{kv_dtype_name(self.dtype)} keys / {kv_dtype_name(self.v_dtype)} values"

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request of `num_tokens` tokens ever holds at once."""
        return cdiv(num_tokens, self.block_size)

    def with_dtype(self, dtype: str):
        """This layer with K and V both stored as `dtype`."""
        return dataclasses.replace(self, dtype=dtype, v_dtype=None)


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
    """Multi-head latent attention: one compressed latent (kv_lora_rank) plus the rope key per token,
    one row that is the keys and the values both. A quantized dtype (MLA_QUANTIZED_DTYPES) stores the
    row's two parts as one-byte codes followed by a float16 scale for each (attention/latent_quant.py),
    inside the block."""

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
        if self.dtype in QUANTIZED_KV_DTYPES and self.dtype not in MLA_QUANTIZED_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_dtype_name(self.dtype)!r} is not built for MLA layers' latent "
                             f"cache; its quantized forms are "
                             f"{', '.join(kv_dtype_name(d) for d in MLA_QUANTIZED_DTYPES)}")
        if self.is_quantized and (self.kv_lora_rank + self.qk_rope_head_dim) % 2:
            raise ValueError(f"a quantized MLA latent row keeps float16 scales at an even byte: kv_lora_rank + "
                             f"qk_rope_head_dim ({self.kv_lora_rank} + {self.qk_rope_head_dim}) must be even")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row as stored: its values, plus the two parts' scales when quantized."""
        values = (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes(self.dtype)
        return values + (MLA_SCALES_BYTES if self.is_quantized else 0)

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.row_bytes

    @property
    def is_quantized(self) -> bool:
        return self.dtype in MLA_QUANTIZED_DTYPES

    @property
    def value_dtype(self) -> str:
        """The values' storage: the latent's own (the row is keys and values both)."""
        return self.dtype

    @property
    def dtype_name(self) -> str:
        return kv_dtype_name(self.dtype)

    def with_dtype(self, dtype: str) -> MLASpec:
        """This layer with its latent rows stored as `dtype`."""
        return dataclasses.replace(self, dtype=dtype)

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


def resolve_kv_dtypes(kv_cache_dtype: str, k_cache_dtype: str | None = None,
                      v_cache_dtype: str | None = None) -> tuple[str, str]:
    """The (K, V) dtype names the three settings choose: kv_cache_dtype for both (a K_V_PRESETS name
    for a split), each side overridden by k_cache_dtype / v_cache_dtype where given."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}")
    for field, value in (("k_cache_dtype", k_cache_dtype), ("v_cache_dtype", v_cache_dtype)):
        if value is not None and value not in KV_SIDE_DTYPES:
            raise ValueError(f"unknown {field} {value!r}; choose one of {list(KV_SIDE_DTYPES)}")
    k, v = K_V_PRESETS.get(kv_cache_dtype, (kv_cache_dtype, kv_cache_dtype))
    k, v = k_cache_dtype or k, v_cache_dtype or v
    if k != v and "auto" not in (k, v):  # with "auto" the pair depends on the model: checked by its spec
        _require_split_pair(_STORED_AS.get(k, k), _STORED_AS.get(v, v))
    return k, v


def with_kv_cache_dtype(spec, kv_cache_dtype: str, k_cache_dtype: str | None = None,
                        v_cache_dtype: str | None = None):
    """The spec with its K and V stored as the settings choose (resolve_kv_dtypes; full and
    sliding-window attention). "auto" keeps that side's dtype. MLA latents take a float choice or a
    quantized one (MLA_QUANTIZED_DTYPES); as their row is the keys and the values both, K and V
    must then choose alike. Recurrent states keep theirs. An unbuilt choice
    (int4 latents, a K/V split outside SPLIT_KV_DTYPES) is refused naming both."""
    k, v = resolve_kv_dtypes(kv_cache_dtype, k_cache_dtype, v_cache_dtype)
    if isinstance(spec, MLASpec):
        return _mla_with_kv_cache_dtype(spec, k, v)
    if not isinstance(spec, FullAttentionSpec):
        return spec
    k_stored = spec.dtype if k == "auto" else _STORED_AS.get(k, k)
    v_stored = spec.value_dtype if v == "auto" else _STORED_AS.get(v, v)
    return dataclasses.replace(spec, dtype=k_stored, v_dtype=None if v_stored == k_stored else v_stored)


def _mla_with_kv_cache_dtype(spec: MLASpec, k: str, v: str) -> MLASpec:
    if k == v == "auto":
        return spec
    if k != v:
        raise ValueError(f"kv_cache_dtype / k_cache_dtype / v_cache_dtype store K as {k!r} and V as {v!r}, but an "
                         f"MLA layer's latent row is its keys and values both: give this model one kv_cache_dtype "
                         f"({', '.join(map(kv_dtype_name, MLA_QUANTIZED_DTYPES))} or a float dtype)")
    return spec.with_dtype(_STORED_AS.get(k, k))  # MLASpec refuses a quantized form it has not
