"""Which replica serves a request (`blockserve serve --data-parallel-size N`): prefix affinity
balanced against load.

Each request's leading full blocks are hashed as the engine hashes them (blockserve.kv.hashing,
the block size and the request's cache salt, so tenants stay apart). Per replica the router keeps
an approximate index of the block hashes it sent there (bounded, least recently routed dropped
first): what that replica's prefix cache most likely holds. Under `affinity` a request goes to
the replica holding the longest run of its leading hashes, unless that replica has more than
`dp_load_imbalance` requests in flight above the least loaded one, or the run is shorter than
`dp_min_prefix_blocks`; then to the least loaded. `round_robin` ignores the prefixes.

Stdlib only (the CLI reads the flags from DataParallelConfig).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockserve.kv.hashing import BlockHash, BlockHashChain

ROUTING_POLICIES = ("affinity", "round_robin")
# Why a request went where it did: the label of blockserve_router_requests_total.
REASONS = ("affinity", "load", "no_match", "round_robin")


@dataclass(frozen=True)
class DataParallelConfig:
    dp_routing: str = field(default="affinity", metadata={
        "help": "how the front end picks a replica: affinity (the one whose prefix cache most likely holds the "
                "request's leading blocks, balanced against load) or round_robin", "choices": ROUTING_POLICIES})
    dp_load_imbalance: int = field(default=4, metadata={
        "help": "affinity routing sends a request to the replica holding its prefix unless that replica has more "
                "than this many requests in flight above the least loaded one"})
    dp_min_prefix_blocks: int = field(default=1, metadata={
        "help": "leading blocks a replica must hold for affinity to pick it; shorter matches go to the least "
                "loaded replica"})
    dp_index_blocks: int = field(default=65536, metadata={
        "help": "block hashes the front end remembers per replica (least recently routed forgotten first)"})
    dp_startup_timeout: float = field(default=600.0, metadata={
        "help": "seconds the front end waits for every replica to load its model and answer /health"})

    def __post_init__(self) -> None:
        if self.dp_routing not in ROUTING_POLICIES:
            raise ValueError(f"dp_routing must be one of {ROUTING_POLICIES}, got {self.dp_routing!r}")
        if self.dp_load_imbalance < 0:
            raise ValueError(f"dp_load_imbalance must be >= 0, got {self.dp_load_imbalance}")
        for name in ("dp_min_prefix_blocks", "dp_index_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.dp_startup_timeout > 0:
            raise ValueError(f"dp_startup_timeout must be > 0 seconds, got {self.dp_startup_timeout}")


def prefix_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`, as the engine's prefix cache names them."""
    return BlockHashChain([block_size], cache_salt).get(block_size, token_ids)


class PrefixIndex:
    """The block hashes routed to one replica, at most `capacity`, least recently routed dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, this replica holds (a chain: the first miss ends it)."""
        count = 0
        for h in hashes:
            if h not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


@dataclass
class ReplicaLoad:
    """What the policy knows of one replica: alive, requests in flight, requests routed so far, its index."""

    index: int
    prefixes: PrefixIndex
    alive: bool = True
    in_flight: int = 0
    routed: int = 0


class RoutingPolicy:
    """Picks a live replica for each request and records the choice (its index, its load)."""

    def __init__(self, replicas: Sequence[ReplicaLoad], config: DataParallelConfig):
        self.replicas = list(replicas)
        self.config = config
        self._next = 0  # round robin's cursor

    def choose(self, hashes: Sequence[BlockHash]) -> tuple[ReplicaLoad, str] | None:
        """(the replica, the reason) for a request whose leading block hashes are `hashes`;
        None when no replica is alive. The caller counts it in flight until it ends (`finish`)."""
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            return None
        if self.config.dp_routing == "round_robin":
            chosen = min(alive, key=lambda r: (r.index - self._next) % len(self.replicas))
            self._next = chosen.index + 1
            reason = "round_robin"
        else:
            chosen, reason = self._by_affinity(alive, hashes)
        chosen.prefixes.add(hashes)
        chosen.in_flight += 1
        chosen.routed += 1
        return chosen, reason

    def _by_affinity(self, alive: list[ReplicaLoad], hashes: Sequence[BlockHash]) -> tuple[ReplicaLoad, str]:
        least = min(alive, key=lambda r: (r.in_flight, r.routed, r.index))
        matches = {r.index: r.prefixes.matched_blocks(hashes) for r in alive}
        best = max(alive, key=lambda r: (matches[r.index], -r.in_flight, -r.index))
        if matches[best.index] < self.config.dp_min_prefix_blocks:
            return least, "no_match"
        if best.in_flight - least.in_flight > self.config.dp_load_imbalance:
            return least, "load"
        return best, "affinity"

    @staticmethod
    def finish(replica: ReplicaLoad) -> None:
        replica.in_flight -= 1
