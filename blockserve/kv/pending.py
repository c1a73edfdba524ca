"""C2: the one place where the KV cache accumulates work for others, drained once per step.

Recorded by the block pools and the state managers, and nowhere else:

    blocks_to_zero[group]     blocks the worker must zero before the next forward pass (C1)
    blocks_to_poison[group]   poison mode: blocks whose content just became garbage (NaN first)
    state_copies[group]       (checkpoint slot, running slot): restore a saved state into a slot
                              instead of zeroing it (C1: "zero, or restore")
    state_captures[group]     request id -> [(position, checkpoint slot)]: during the forward,
                              save the state after the first `position` tokens into that slot
    blocks_to_save[group]     (block, tier key): copy the block out to the second tier
                              (kv/tiers/), before any other order can change it
    blocks_to_load[group]     (block, verified payload): write a block loaded from the second
                              tier; such a block gets no zero order (C1) and is cached only after
                              the step's forward (C4)

The worker applies them in this order: saves, poison, copies, loads, zeros, then the forward with
captures.
The scheduler calls `KVCacheManager.take_pending()` exactly once per `schedule()`, whatever
the model, so nothing can accumulate across steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PendingWork:
    blocks_to_zero: dict[int, list[int]] = field(default_factory=dict)
    blocks_to_poison: dict[int, list[int]] = field(default_factory=dict)
    state_copies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    state_captures: dict[int, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)
    blocks_to_save: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    blocks_to_load: dict[int, list[tuple[int, bytearray]]] = field(default_factory=dict)

    def take(self) -> PendingWork:
        """Hand over everything recorded so far and start empty."""
        taken = PendingWork(self.blocks_to_zero, self.blocks_to_poison, self.state_copies, self.state_captures,
                            self.blocks_to_save, self.blocks_to_load)
        self.blocks_to_zero = {}
        self.blocks_to_poison = {}
        self.state_copies = {}
        self.state_captures = {}
        self.blocks_to_save = {}
        self.blocks_to_load = {}
        return taken

    def is_empty(self) -> bool:
        return not (self.blocks_to_zero or self.blocks_to_poison or self.state_copies or self.state_captures
                    or self.blocks_to_save or self.blocks_to_load)
