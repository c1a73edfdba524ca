"""The KV cache's shape: its groups, their pool sizes, and their derived zero flags."""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.kv.specs import KVCacheSpec, LinearStateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, one block table per request and one pool of `num_blocks`.

    Block 0 of every pool is the null block (never handed out; skipped sliding-window blocks
    point at it), so a pool holds `num_blocks - 1` usable blocks or state slots.

    `zero_new_blocks` is the C1 flag derived once by `specs.zero_new_blocks`; the scheduler
    and the worker both read it from here.
    """

    spec: KVCacheSpec
    num_blocks: int
    zero_new_blocks: bool
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(
                f"a KV cache group needs the null block plus at least one usable block, got num_blocks={self.num_blocks}"
            )

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, LinearStateSpec)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all the group's layers."""
        return self.spec.page_size_bytes * max(1, len(self.layer_names))


@dataclass(frozen=True)
class KVCacheConfig:
    groups: tuple[KVCacheGroup, ...]
    enable_prefix_caching: bool = True
    poison_freed_blocks: bool = False  # poison mode: garbage blocks are filled with NaN (C1 tests)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache needs at least one group")

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The distinct token block sizes of the attention groups (those with prefix hashes)."""
        return tuple(sorted({g.spec.block_size for g in self.groups if not g.is_state}))

    def capacity_report(self) -> str:
        """One line per group: its capacity in its own units and its bytes."""
        lines = []
        total = 0
        for i, group in enumerate(self.groups):
            spec = group.spec
            nbytes = group.num_blocks * group.bytes_per_block
            total += nbytes
            usable = group.num_blocks - 1
            if group.is_state:
                what = f"{usable} state slots"
            else:
                what = f"{usable} blocks x {spec.block_size} = {usable * spec.block_size} tokens"
            lines.append(
                f"group {i} {type(spec).__name__} ({len(group.layer_names)} layers): {what}, "
                f"{nbytes / 2**20:.1f} MiB, zero new blocks: {'yes' if group.zero_new_blocks else 'no'}"
            )
        lines.append(f"KV cache total: {total / 2**20:.1f} MiB")
        return "\n".join(lines)
