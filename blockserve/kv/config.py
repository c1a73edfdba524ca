"""The KV cache's shape: its groups, their pool sizes, and their derived zero flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

from blockserve.kv.specs import KVCacheSpec, LinearStateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, one block table per request and one pool of `num_blocks`.

    Block 0 of every pool is the null block (never handed out; skipped sliding-window blocks
    point at it), so a pool holds `num_blocks - 1` usable blocks or state slots.

    `zero_new_blocks` is the C1 flag derived once by `specs.zero_new_blocks`; the scheduler
    and the worker both read it from here.

    A state group's tensors hold `num_blocks` running slots followed by `num_checkpoints`
    checkpoint slots (saved states that prefix-cache hits restore): slot ids
    [num_blocks, num_blocks + num_checkpoints).
    """

    spec: KVCacheSpec
    num_blocks: int
    zero_new_blocks: bool
    layer_names: tuple[str, ...] = ()
    num_checkpoints: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(
                f"a KV cache group needs the null block plus at least one usable block, got num_blocks={self.num_blocks}"
            )
        if self.num_checkpoints < 0 or (self.num_checkpoints and not self.is_state):
            raise ValueError(f"only state groups hold checkpoints (a count >= 0), got {self.num_checkpoints} "
                             f"for a {type(self.spec).__name__} group")

    @property
    def num_slots(self) -> int:
        """Block (or state slot) ids in the group's tensors: its pool plus its checkpoints."""
        return self.num_blocks + self.num_checkpoints

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, LinearStateSpec)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all the group's layers."""
        return self.spec.page_size_bytes * max(1, len(self.layer_names))


@dataclass(frozen=True)
class KVCacheConfig:
    """The groups, and how prefix caching treats them.

    State checkpoints sit only at multiples of `checkpoint_stride` = lcm(every attention group's
    block size, every state kernel's chunk length), so a restored state always lines up with
    whole attention blocks and resumes exactly. `checkpoint_interval` > 0 also checkpoints every
    that many strides inside prompts (for long documents). `checkpoint_savings_weight` in [0, 1]
    is the eviction policy's weight on the tokens a checkpoint saves (0: plain LRU).
    """

    groups: tuple[KVCacheGroup, ...]
    enable_prefix_caching: bool = True
    poison_freed_blocks: bool = False  # poison mode: garbage blocks are filled with NaN (C1 tests)
    checkpoint_interval: int = 0
    checkpoint_savings_weight: float = 0.0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache needs at least one group")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0 strides (0: off), got {self.checkpoint_interval}")
        if not 0 <= self.checkpoint_savings_weight <= 1:
            raise ValueError(f"checkpoint_savings_weight must be in [0, 1], got {self.checkpoint_savings_weight}")

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The distinct token block sizes of the attention groups (those with prefix hashes)."""
        return tuple(sorted({g.spec.block_size for g in self.groups if not g.is_state}))

    @property
    def checkpoint_stride(self) -> int:
        """Tokens between the positions a state checkpoint may sit at (see the class docstring)."""
        sizes = [*self.block_sizes, *(g.spec.chunk_size for g in self.groups if g.is_state)]
        return math.lcm(*sizes) if sizes else 1

    @property
    def checkpointing(self) -> bool:
        """Prefix caching is on and every state group (there is one at least) has checkpoint slots."""
        states = [g for g in self.groups if g.is_state]
        return self.enable_prefix_caching and bool(states) and all(g.num_checkpoints for g in states)

    @property
    def hash_block_sizes(self) -> tuple[int, ...]:
        """The block sizes a request's hash chain is kept at: the attention groups' and, for
        checkpoint keys, the stride."""
        if not self.checkpointing:
            return self.block_sizes
        return tuple(sorted({*self.block_sizes, self.checkpoint_stride}))

    def capacity_report(self) -> str:
        """One line per group: its capacity in its own units and its bytes."""
        lines = []
        total = 0
        attention_bytes_per_token = sum(g.bytes_per_block / g.spec.block_size for g in self.groups if not g.is_state)
        for i, group in enumerate(self.groups):
            spec = group.spec
            nbytes = group.num_slots * group.bytes_per_block
            total += nbytes
            usable = group.num_blocks - 1
            if group.is_state:
                what = f"{usable} state slots"
                if group.num_checkpoints:
                    ckpt_bytes = group.num_checkpoints * group.bytes_per_block
                    what += f" + {group.num_checkpoints} checkpoints every {self.checkpoint_stride} tokens"
                    if attention_bytes_per_token:
                        what += f" (≈ {ckpt_bytes / attention_bytes_per_token:,.0f} tokens of attention KV)"
            else:
                what = f"{usable} blocks x {spec.block_size} = {usable * spec.block_size} tokens"
                if getattr(spec, "is_quantized", False):  # what the same memory holds, against float16 K/V
                    float16_page = spec.with_dtype("float16").page_size_bytes
                    per_gib = 2**30 / group.bytes_per_block * spec.block_size
                    what += (f" of {spec.dtype_name} ({per_gib:,.0f} tokens per GiB, "
                             f"{float16_page / spec.page_size_bytes:.2f}x float16)")
            lines.append(
                f"group {i} {type(spec).__name__} ({len(group.layer_names)} layers): {what}, "
                f"{nbytes / 2**20:.1f} MiB, zero new blocks: {'yes' if group.zero_new_blocks else 'no'}"
            )
        lines.append(f"KV cache total: {total / 2**20:.1f} MiB")
        return "\n".join(lines)
