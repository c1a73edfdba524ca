"""Speculative decoding over recurrent-state layers: the running slot after a verification.

A verified request's k + 1 rows run through each state layer as one chain
(`attention/state_decodes.py`), which leaves the state after the last row in the request's
running slot and keeps the state after every row in the step's `StateMetadata.row_states`.
Once the target has accepted a of the k drafts, the slot must hold the state after row a (the
request's last token and the accepted drafts): if a < k that state is copied, per state layer
and component, from the kept rows into the slot. No token is computed again, and the slot
never holds state from a rejected draft when the next step reads it.
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
        first, rows = self.chains[request_id]
        if not 1 <= num_tokens_kept <= rows:
            raise ValueError(f"request {request_id}: {num_tokens_kept} tokens kept of {rows} verified")
        if num_tokens_kept == rows:
            return  # every draft accepted: the slot holds the last row's state already
        row = first + num_tokens_kept - 1
        for name, cache in self.layers:
            meta: StateMetadata = self.metadata[cache.group]
            kept = meta.row_states.get(name)
            if kept is None:
                raise RuntimeError(f"layer {name} kept no per-row states for request {request_id}'s verification")
            slot = meta.slot_ids[first]
            for tensor, states in zip(cache.tensors, kept):
                tensor[slot] = states[row]

    def release(self) -> None:
        """Drop the kept per-row states (the step's verifications are all rolled back)."""
        for meta in self.metadata:
            if isinstance(meta, StateMetadata):
                meta.row_states.clear()
