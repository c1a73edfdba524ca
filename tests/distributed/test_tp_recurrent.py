"""Tensor parallelism for the recurrent-state families, 2 gloo ranks of one thread each: TP=2 gives
TP=1's greedy tokens and its top-3 logprobs per step (and prompt logprobs) within 1e-4 (the partial
sums of the row-parallel layers are added in another order), for Qwen3-Next (Gated DeltaNet, gated
attention, MoE with a shared expert), Granite 4.0-H (Mamba2 with one B/C group shared by both ranks,
so its gated norm all-reduces; attention; MoE) and Kimi Linear (KDA, MLA, DeepSeek MoE). Each rank's
state slot holds half the heads; shapes that cannot be sharded are refused naming the dimension.

One TP=2 engine per family in the default suite; Granite with one B/C group per rank (its norm
local) runs under `-m tp_full`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv.specs import LinearStateSpec
from blockserve.models.base import CausalLM
from blockserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from blockserve.models.kimi_linear import KimiLinearForCausalLM
from blockserve.models.placement import Placement
from blockserve.models.qwen3_next import Qwen3NextForCausalLM
from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model
from blockserve.tensor_parallel.layers import shared_head_slice
from tests.distributed.processes import child_pids
from tests.distributed.test_tp_engine import _assert_same, _generate
from tests.models.conftest import MLA_CONFIGS, STATE_CONFIGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _granite(groups: int):
    config = STATE_CONFIGS["granitemoehybrid"]()
    config.mamba_n_groups = groups
    return config


FAMILIES = {  # name -> (config, save, conv channels of one rank's state slot)
    # 2 key heads (one per rank, with its 2 value heads): q, k 16 + v 2 x 8 channels per rank
    "qwen3_next": (STATE_CONFIGS["qwen3_next"], save_random_model, 16 + 16 + 2 * 8),
    # 8 Mamba2 heads of 16 (4 per rank), one B/C group of state size 16, replicated on both ranks
    "granite-1group": (lambda: _granite(1), save_random_model, 4 * 16 + 2 * 16),
    # 2 groups: one per rank, the gated norm within the rank
    "granite-2groups": (lambda: _granite(2), save_random_model, 4 * 16 + 2 * 16),
    # 2 KDA heads of 16 (one per rank): q | k | v channels
    "kimi_linear": (MLA_CONFIGS["kimi_linear"], save_random_hybrid, 3 * 16),
}
SLOWER = {"granite-2groups"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            config, save, _ = FAMILIES[name]
            save(config(), path)
            built[name] = str(path)
        return built[name]

    return get


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.tp_full] if f in SLOWER else [])
                                    for f in sorted(FAMILIES)])
def test_tp2_equals_tp1(saved, family):
    path = saved(family)
    before = child_pids()
    tp1, groups1 = _generate(path)
    tp2, groups2 = _generate(path, tensor_parallel_size=2)
    assert not child_pids() - before  # closed: rank 1 has exited
    _assert_same(tp1, tp2)
    states = [(one, two) for one, two in zip(groups1, groups2) if isinstance(one[0], LinearStateSpec)]
    assert states
    for (spec1, slots1), (spec2, slots2) in states:  # this rank's heads only, so its slot is smaller
        (conv1, recurrent1), (conv2, recurrent2) = spec1.shapes, spec2.shapes
        assert recurrent2 == (recurrent1[0] // 2, *recurrent1[1:])
        assert conv2 == (FAMILIES[family][2], conv1[1])
        assert spec2.page_size_bytes < spec1.page_size_bytes and slots2 >= slots1


class _Shard(SimpleNamespace):
    """Enough of a TensorParallelGroup to build (not run) a rank's shard."""


def _with(config, **overrides):
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("model, config, size, dimension", [
    (Qwen3NextForCausalLM, lambda: STATE_CONFIGS["qwen3_next"](), 4, "linear_num_key_heads = 2"),
    (GraniteMoeHybridForCausalLM, lambda: _with(_granite(2), mamba_n_heads=12), 3, "mamba_n_groups = 2"),
    (GraniteMoeHybridForCausalLM, lambda: _with(_granite(1), mamba_n_heads=6), 4, "mamba_n_heads = 6"),
    (KimiLinearForCausalLM, lambda: MLA_CONFIGS["kimi_linear"](), 4, "linear_num_heads = 2"),
])
def test_unshardable_shape_is_refused_naming_the_dimension(model, config, size, dimension):
    with pytest.raises(ValueError, match=dimension):
        model(config(), BACKENDS["exact"], Placement(tp=_Shard(rank=0, size=size)))


def test_family_without_tensor_parallel_is_refused():
    class Unsharded(CausalLM):
        pass

    with pytest.raises(ValueError, match="Unsharded does not support tensor parallelism"):
        Unsharded.check_tensor_parallel(2)
    Unsharded.check_tensor_parallel(1)


@pytest.mark.parametrize("groups, size, rows", [
    (2, 2, [(0, 16), (16, 16)]),  # one group per rank
    (1, 2, [(0, 16), (0, 16)]),  # the one group on both ranks
    (2, 4, [(0, 16), (0, 16), (16, 16), (16, 16)]),  # each group on the two ranks of its heads
])
def test_groups_are_sharded_or_replicated(groups, size, rows):
    slices = [shared_head_slice(groups, 16, _Shard(rank=r, size=size), "mamba_n_groups") for r in range(size)]
    assert [(s.start, s.size) for s in slices] == rows and {s.full for s in slices} == {groups * 16}
