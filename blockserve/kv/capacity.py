"""Turn a memory budget into a pool size per group, each in its own units.

State groups get one slot per sequence that can run at once (plus the null slot) and, with
prefix caching on, `checkpoint_share` of the budget as checkpoint slots (the same count in every
state group, since a checkpoint is only useful when every group has it). The rest of the budget
is shared by the attention groups so that they run out together: each gets tokens in proportion
to what one request of `max_model_len` tokens holds in it (a sliding window holds at most its
window, however long the request).

    budget ─► state slots: (max_num_seqs + 1) x slot bytes
           ├► checkpoints: n = share x budget / sum of slot bytes over state groups
           └► attention: k = rest / sum(need_g x bytes_per_token_g); tokens_g = k x need_g

A proposer's model (a draft model, an MTP head) draws its own cache from the same budget
(`plan_with_proposer`): its groups are planned beside the target's, so both hold as many tokens of
one request and run out together.
"""

from __future__ import annotations

import dataclasses

from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import KVCacheSpec, LinearStateSpec, zero_new_blocks


def plan_kv_cache(
    groups: list[tuple[KVCacheSpec, tuple[str, ...], bool]],
    memory_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    max_chunk_tokens: int | None = None,
    checkpoint_share: float = 0.0,
    **config_options,
) -> KVCacheConfig:
    """`groups`: (spec, layer names, backend_reads_unwritten_slots) per group. Raises ValueError,
    saying how much memory is needed, if the budget cannot hold one request of max_model_len.
    `checkpoint_share` in [0, 1): the budget's share for state checkpoints when prefix caching is on."""
    if not 0 <= checkpoint_share < 1:
        raise ValueError(f"the checkpoint share of the KV budget must be in [0, 1), got {checkpoint_share}")
    state_bytes = slot_bytes = 0
    needs = []  # per attention group: (index, blocks one longest request holds, bytes per block)
    for i, (spec, layers, _) in enumerate(groups):
        per_block = spec.page_size_bytes * max(1, len(layers))
        if isinstance(spec, LinearStateSpec):
            state_bytes += (max_num_seqs + 1) * per_block
            slot_bytes += per_block
        else:
            needs.append((i, spec.max_blocks_held(max_model_len, max_chunk_tokens), per_block))
    null_bytes = sum(per_block for _, _, per_block in needs)
    one_request = sum(blocks * per_block for _, blocks, per_block in needs)
    num_checkpoints = 0
    if slot_bytes and config_options.get("enable_prefix_caching", True):
        # Never at the cost of the one longest request the attention groups must hold.
        room = max(0, memory_bytes - state_bytes - null_bytes - one_request)
        num_checkpoints = min(int(checkpoint_share * memory_bytes), room) // slot_bytes
        state_bytes += num_checkpoints * slot_bytes
    spare = memory_bytes - state_bytes - null_bytes
    if spare < one_request:
        raise ValueError(
            f"the KV cache budget of {memory_bytes / 2**20:.2f} MiB cannot hold even one request of "
            f"max_model_len={max_model_len} tokens (that needs "
            f"{(state_bytes + null_bytes + one_request) / 2**20:.2f} MiB); "
            f"give the KV cache more memory or lower max_model_len / max_num_seqs"
        )
    scale = spare / one_request if one_request else 0.0
    num_blocks = {i: int(blocks * scale) + 1 for i, blocks, _ in needs}  # + the null block
    built = []
    for i, (spec, layers, reads_unwritten) in enumerate(groups):
        is_state = isinstance(spec, LinearStateSpec)
        count = max_num_seqs + 1 if is_state else num_blocks[i]
        built.append(KVCacheGroup(spec, count, zero_new_blocks(spec, reads_unwritten), tuple(layers),
                                  num_checkpoints if is_state else 0))
    return KVCacheConfig(tuple(built), **config_options)


def plan_with_proposer(
    groups: list[tuple[KVCacheSpec, tuple[str, ...], bool]],
    proposer_groups: list[tuple[KVCacheSpec, tuple[str, ...], bool]],
    memory_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    max_chunk_tokens: int | None = None,
    checkpoint_share: float = 0.0,
    proposer_caching: bool = False,
    **config_options,
) -> tuple[KVCacheConfig, KVCacheConfig]:
    """One budget for a model's groups and its proposer's: `plan_kv_cache` over both together (so the
    attention groups of both run out together, and one request of max_model_len fits in each), split
    into the model's KVCacheConfig (with `config_options`) and the proposer's, which has the model's
    poison setting and prefix caching only with `proposer_caching` and the model's on."""
    together = plan_kv_cache([*groups, *proposer_groups], memory_bytes, max_model_len, max_num_seqs,
                             max_chunk_tokens, checkpoint_share, **config_options)
    own, proposer = together.groups[:len(groups)], together.groups[len(groups):]
    caching = proposer_caching and together.enable_prefix_caching
    return (dataclasses.replace(together, groups=own),
            KVCacheConfig(proposer, enable_prefix_caching=caching, poison_freed_blocks=together.poison_freed_blocks))
