"""Speculative decoding over recurrent-state layers: the running slot after a verification.

A verified request's k + 1 rows run through each state layer as one chain
(`attention/state_decodes.py`), which leaves the state after the last row in the request's
running slot and keeps the state after every row in the step's `StateMetadata.row_states`.
Once the target has accepted a of the k drafts, the slot must hold the state after row a (the
request's last token and the accepted drafts): if a < k that state is copied, per state layer
and component, from the kept rows into the slot. No token is computed again, and the slot
never holds state from a rejected draft when the next step reads it. A tensor-parallel rank above 0
does not sample, so it learns a from the request's next step: it keeps a copy of the request's rows'
states until then (`StateRollback.defer`), and rolls its slot back as that step begins, before its
forward (worker/input_batch.py).

A draft model with state layers chains its drafts one forward each, so it keeps no per-row states:
`StateSnapshots` saves a request's slots once its own tokens are fed and puts them back after the
chain (worker/runner_proposer.py).
"""

from __future__ import annotations

from blockserve.attention.context import StateCache, StateMetadata


class StateRollback:
    """The rollback of one step's verified requests; call once per verified request, then `release`."""

    def __init__(self, chains: dict[str, tuple[int, int]], metadata: list, layer_caches: dict):
        """`chains`: StepInputs.chains; `metadata`: the step's per-group metadata; `layer_caches`:
        the runner's ForwardContext layers."""
        self.chains = chains
        self.metadata = metadata
        self.layers = [(name, cache) for name, cache in layer_caches.items() if isinstance(cache, StateCache)]

    def __call__(self, request_id: str, num_tokens_kept: int) -> None:
        """Leave in the request's running slots the state after its first `num_tokens_kept` verified
        rows (1 + the accepted drafts)."""
        rows = self.chains[request_id][1]
        _check(request_id, num_tokens_kept, rows)
        if num_tokens_kept < rows:  # all kept: the slot holds the last row's state already
            _roll_back(self._kept(request_id), num_tokens_kept)

    def defer(self, request_id: str) -> DeferredRollback:
        """The request's rollback, its rows' states copied, for a rank that learns how many drafts were
        accepted only from the request's next step (tensor parallelism, rank > 0)."""
        return DeferredRollback(request_id, self.chains[request_id][1],
                                [(tensor, slot, rows.clone()) for tensor, slot, rows in self._kept(request_id)])

    def _kept(self, request_id: str) -> list[tuple]:
        """(running state tensor, the request's slot, the states after each of its rows) per state layer
        and component."""
        first, rows = self.chains[request_id]
        kept = []
        for name, cache in self.layers:
            meta: StateMetadata = self.metadata[cache.group]
            states = meta.row_states.get(name)
            if states is None:
                raise RuntimeError(f"layer {name} kept no per-row states for request {request_id}'s verification")
            slot = meta.slot_ids[first]
            kept += [(tensor, slot, component[first:first + rows]) for tensor, component in zip(cache.tensors, states)]
        return kept

    def release(self) -> None:
        """Drop the kept per-row states (the step's verifications are all rolled back)."""
        for meta in self.metadata:
            if isinstance(meta, StateMetadata):
                meta.row_states.clear()


class DeferredRollback:
    """A verified request's rollback, held until its accepted count is known (StateRollback.defer)."""

    def __init__(self, request_id: str, rows: int, kept: list[tuple]):
        self.request_id, self.rows, self.kept = request_id, rows, kept

    def __call__(self, num_tokens_kept: int) -> None:
        """Leave in the request's running slots the state after its first `num_tokens_kept` verified rows."""
        _check(self.request_id, num_tokens_kept, self.rows)
        if num_tokens_kept < self.rows:
            _roll_back(self.kept, num_tokens_kept)


def _check(request_id: str, num_tokens_kept: int, rows: int) -> None:
    if not 1 <= num_tokens_kept <= rows:
        raise ValueError(f"request {request_id}: {num_tokens_kept} tokens kept of {rows} verified")


def _roll_back(kept: list[tuple], num_tokens_kept: int) -> None:
    """slot := the state after row `num_tokens_kept` - 1, in each (state tensor, slot, per-row states)."""
    for tensor, slot, rows in kept:
        tensor[slot] = rows[num_tokens_kept - 1]


class StateSnapshots:
    """A proposer's rollback of its own running slots past the drafts it chains: `save` a request's
    slots once its own tokens are fed, `restore_all` after its drafts were chained through them, so
    that each slot holds the state after the request's tokens again (its drafts, which the target may
    reject, are fed again from there only as far as the target kept them). A saved state is a copy of
    one slot per state layer and component, held for the length of one proposal."""

    def __init__(self, layer_caches: dict):
        """`layer_caches`: the proposer runner's ForwardContext layers."""
        self.layers = [cache for cache in layer_caches.values() if isinstance(cache, StateCache)]
        self._saved: dict[str, list[tuple[int, list]]] = {}  # request id -> per layer (slot, component copies)

    def save(self, request_id: str, block_ids: list[list[int]]) -> None:
        """Copy the request's running slots (`block_ids`: its table per group, a state group's [slot])."""
        saved = []
        for cache in self.layers:
            slot = block_ids[cache.group][0]
            saved.append((slot, [tensor[slot].clone() for tensor in cache.tensors]))
        self._saved[request_id] = saved

    def restore_all(self) -> None:
        """Put every saved state back into its slot and forget it."""
        for saved in self._saved.values():
            for cache, (slot, copies) in zip(self.layers, saved):
                for tensor, copy in zip(cache.tensors, copies):
                    tensor[slot] = copy
        self._saved.clear()

    def clear(self) -> None:
        """Forget the saved states unrestored (the proposal failed: its requests start over)."""
        self._saved.clear()
