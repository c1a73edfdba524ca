"""Engine settings, validated once, with vLLM's names where vLLM has one."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def available_memory_bytes() -> int:
    """Memory the system could give us now (Linux MemAvailable; total RAM elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_memory(value: str | int | float) -> int:
    """'4GiB', '512MB', 1073741824 -> bytes; a number in (0, 1] -> that fraction of available memory."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 0 < value <= 1:
            return int(value * available_memory_bytes())
        if value > 1:
            return int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match and match.group(2).lower() in _UNITS:
            return parse_memory(float(match.group(1)) * _UNITS[match.group(2).lower()]
                                if match.group(2) else float(match.group(1)))
    raise ValueError(
        f"cannot read kv_cache_memory={value!r}: give bytes with a unit ('4GiB', '512MB') "
        f"or a fraction of available memory in (0, 1] (0.2)"
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face directory or a .gguf file; None: the bundled SmolLM2
    max_model_len: int | None = None  # None: the model's maximum, capped at 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_prefill_chunk: int | None = None
    scheduling_policy: str = "fcfs"
    kv_cache_memory: str | int | float = "1GiB"
    attention_backend: str = "exact"  # or "whole_block"
    # K/V of attention layers stored as float16 / bfloat16 (half the memory and reads; attention
    # still computes in float32) or "auto": the model's dtype. MLA and recurrent states keep theirs.
    kv_cache_dtype: str = "auto"
    poison: bool = False  # fill garbage KV blocks with NaN (also BLOCKSERVE_POISON=1)
    check_integrity: bool = False  # run the KV books check after every step (also BLOCKSERVE_CHECK=1)
    unsafe_disable_zeroing: bool = False  # C1 tests only: ignore the derived zero flags
    seed: int | None = 0  # for requests without their own seed
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # GGUF models: small batches read the Q4_0/Q4_1/Q8_0 blocks (quantized_linear.py); applies when the
    # engine loads the model (a LoadedModel passed in was loaded with load_model's own setting)
    quantized_matmul: bool = True

    def __post_init__(self) -> None:
        from blockserve.attention.paged_attention import BACKENDS
        from blockserve.kv.specs import KV_CACHE_DTYPES

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose one of {sorted(BACKENDS)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        parse_memory(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}")

    @property
    def poison_enabled(self) -> bool:
        return self.poison or os.environ.get("BLOCKSERVE_POISON") == "1"

    @property
    def check_enabled(self) -> bool:
        return self.check_integrity or os.environ.get("BLOCKSERVE_CHECK") == "1"
