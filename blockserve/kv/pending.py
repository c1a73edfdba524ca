"""C2: the one place where the KV cache accumulates work for others, drained once per step.

Zero orders (blocks the worker must zero before the next forward pass) and poison orders (in
poison mode: blocks whose content just became garbage, to be filled with NaN first) are recorded
here by the block pools, and nowhere else. The scheduler calls `KVCacheManager.take_pending()` exactly once per `schedule()`, whatever the
model, so nothing can accumulate across steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PendingWork:
    blocks_to_zero: dict[int, list[int]] = field(default_factory=dict)
    blocks_to_poison: dict[int, list[int]] = field(default_factory=dict)

    def take(self) -> PendingWork:
        """Hand over everything recorded so far and start empty."""
        taken = PendingWork(self.blocks_to_zero, self.blocks_to_poison)
        self.blocks_to_zero = {}
        self.blocks_to_poison = {}
        return taken

    def is_empty(self) -> bool:
        return not self.blocks_to_zero and not self.blocks_to_poison
