"""KV configurations the simulator tests run over."""

from __future__ import annotations

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec, MLASpec, SlidingWindowSpec
from blockserve.kv.specs import zero_new_blocks

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)
SLIDING = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=7)
MLA = MLASpec(block_size=4, kv_lora_rank=16, qk_rope_head_dim=4)
STATE = LinearStateSpec(shapes=((4, 3), (2, 8, 8)), dtypes=("float32", "float32"))
# Quantized K/V (attention/kv_quant.py): their blocks are bytes of codes and scales, of other page
# sizes than float32's, under the same manager; recurrent states stay float32 beside them
FULL_INT8 = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="int8")
SLIDING_INT4 = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=7, dtype="int4_rotated")

# name -> (specs, what each group's backend declares about reading unwritten slots)
LAYOUTS = {
    "full": ((FULL,), (True,)),
    "full+sliding": ((FULL, SLIDING), (True, True)),
    "mla+state": ((MLA, STATE), (True, False)),
    "int8+int4-sliding+state": ((FULL_INT8, SLIDING_INT4, STATE), (True, True, False)),
}


def kv_config(layout: str, num_blocks: int, prefix_caching: bool = True, zeroing: bool = True,
              num_checkpoints: int = 6, poison: bool = False, savings_weight: float = 0.0) -> KVCacheConfig:
    """A config whose zero flags are derived (C1), or forced off with `zeroing=False`; state
    groups get `num_checkpoints` checkpoint slots when prefix caching is on."""
    specs, reads = LAYOUTS[layout]
    groups = tuple(
        KVCacheGroup(spec, num_blocks if not isinstance(spec, LinearStateSpec) else 9,
                     zeroing and zero_new_blocks(spec, r), ("layer",),
                     num_checkpoints if isinstance(spec, LinearStateSpec) and prefix_caching else 0)
        for spec, r in zip(specs, reads)
    )
    return KVCacheConfig(groups, enable_prefix_caching=prefix_caching, poison_freed_blocks=poison,
                         checkpoint_savings_weight=savings_weight)
