"""Checkpoint tensors onto parameters (models/weights.py): pieces assemble in order whatever their arrival order,
the narrowing hook sees full tensors, errors name the weights, and the placement decides dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.layers import RMSNorm
from blockserve.models.llama import LlamaForCausalLM
from blockserve.models.moe import Experts
from blockserve.models.placement import Placement
from blockserve.models.weights import QKV, SWIGLU_EXPERTS, CheckpointLayout, load_checkpoint

LAYOUT = CheckpointLayout(fused=(QKV,), experts=SWIGLU_EXPERTS)
PLACEMENT = Placement()


class Tiny(nn.Module):
    """A fused q/k/v (2 rows each), 3 stacked experts (H 4, I 2) and a norm, on the meta device."""

    def __init__(self, rows_per_part: int = 2):
        super().__init__()
        with torch.device("meta"):
            self.attn = nn.Module()
            self.attn.qkv_proj = nn.Linear(4, 3 * rows_per_part, bias=False)
            self.mlp = nn.Module()
            self.mlp.experts = Experts(3, 4, 2)
            self.norm = RMSNorm(4, 1e-6)


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {f"attn.{p}_proj.weight": torch.randn(2, 4, generator=gen) for p in "qkv"}
    for e in range(3):
        weights |= {f"mlp.experts.{e}.{p}_proj.weight": torch.randn(2, 4, generator=gen) for p in ("gate", "up")}
        weights[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(4, 2, generator=gen)
    weights["norm.weight"] = torch.randn(4, generator=gen)
    return weights


def test_pieces_assemble_in_declared_order_whatever_the_arrival_order():
    weights = checkpoint()
    model = Tiny()
    load_checkpoint(model, reversed(list(weights.items())), LAYOUT, PLACEMENT, num_layers=0)
    torch.testing.assert_close(model.attn.qkv_proj.weight, torch.cat([weights[f"attn.{p}_proj.weight"] for p in "qkv"]))
    for e in range(3):
        gate_up = torch.cat([weights[f"mlp.experts.{e}.gate_proj.weight"], weights[f"mlp.experts.{e}.up_proj.weight"]])
        torch.testing.assert_close(model.mlp.experts.gate_up_proj[e], gate_up)
        torch.testing.assert_close(model.mlp.experts.down_proj[e], weights[f"mlp.experts.{e}.down_proj.weight"])
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())


def test_stacked_experts_may_arrive_whole():
    per_expert, whole = Tiny(), Tiny()
    weights = checkpoint()
    load_checkpoint(per_expert, weights.items(), LAYOUT, PLACEMENT, num_layers=0)
    stacked = {k: v for k, v in weights.items() if ".experts." not in k}
    stacked["mlp.experts.gate_up_proj"] = per_expert.mlp.experts.gate_up_proj.detach().clone()
    stacked["mlp.experts.down_proj"] = per_expert.mlp.experts.down_proj.detach().clone()
    load_checkpoint(whole, stacked.items(), LAYOUT, PLACEMENT, num_layers=0)
    for (name, a), (_, b) in zip(per_expert.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), name


def test_weight_loader_gets_every_full_tensor_and_may_narrow_it():
    """The tensor-parallel extension point: the model declares the narrowed shape, the hook sees
    each full checkpoint tensor with its piece and returns the rows to copy in."""
    model = Tiny(rows_per_part=1)
    seen = []

    def first_row(tensor, *, part, expert):
        seen.append((tuple(tensor.shape), part, expert))
        return tensor[:1]

    model.attn.qkv_proj.weight.weight_loader = first_row
    weights = checkpoint()
    load_checkpoint(model, weights.items(), LAYOUT, PLACEMENT, num_layers=0)
    assert sorted(seen) == [((2, 4), 0, None), ((2, 4), 1, None), ((2, 4), 2, None)]
    torch.testing.assert_close(model.attn.qkv_proj.weight,
                               torch.cat([weights[f"attn.{p}_proj.weight"][:1] for p in "qkv"]))


def test_errors_name_the_weights():
    weights = checkpoint()
    with pytest.raises(ValueError, match=r"unexpected weights \['mlp\.experts\.3\.down_proj\.weight'\], "
                                         r"missing weights \['attn\.k_proj\.weight', 'mlp\.experts\.1\.up_proj\.weight'\]"):
        load_checkpoint(Tiny(), [(k, v) for k, v in weights.items() if k not in
                                 ("attn.k_proj.weight", "mlp.experts.1.up_proj.weight")]
                        + [("mlp.experts.3.down_proj.weight", torch.zeros(4, 2))], LAYOUT, PLACEMENT, num_layers=0)
    with pytest.raises(ValueError, match=r"missing weights \['attn\.q_proj\.weight', 'attn\.k_proj\.weight', "
                                         r"'attn\.v_proj\.weight'\]"):
        load_checkpoint(Tiny(), [(k, v) for k, v in weights.items() if not k.startswith("attn.")], LAYOUT,
                        PLACEMENT, num_layers=0)
    with pytest.raises(ValueError, match=r"weight norm\.weight has shape \(5,\).*expects \(4,\) for norm\.weight"):
        load_checkpoint(Tiny(), (weights | {"norm.weight": torch.zeros(5)}).items(), LAYOUT, PLACEMENT, num_layers=0)
    with pytest.raises(ValueError, match=r"do not assemble into the \(6, 4\).*attn\.qkv_proj\.weight"):
        load_checkpoint(Tiny(), (weights | {"attn.v_proj.weight": torch.zeros(2, 5)}).items(), LAYOUT, PLACEMENT,
                        num_layers=0)


def test_renames_and_ignores():
    layout = CheckpointLayout(fused=(QKV,), experts=SWIGLU_EXPERTS, renames=((r"^self_attn\.", "attn."),),
                              ignore=(r"^mtp\.",), ignore_layers_past_config=True)
    weights = {k.replace("attn.", "self_attn.", 1) if k.startswith("attn.") else k: v for k, v in checkpoint().items()}
    extra = {"mtp.head.weight": torch.zeros(1), "model.layers.2.eh_proj.weight": torch.zeros(1),
             "model.rotary_emb.inv_freq": torch.zeros(1), "lm_head.weight": torch.zeros(1)}
    load_checkpoint(Tiny(), (weights | extra).items(), layout, PLACEMENT, num_layers=2,
                    ignore_names=frozenset({"lm_head.weight"}))
    with pytest.raises(ValueError, match=r"unexpected weights \['model\.layers\.1\.eh_proj\.weight'\]"):
        load_checkpoint(Tiny(), (weights | {"model.layers.1.eh_proj.weight": torch.zeros(1)}).items(), layout,
                        PLACEMENT, num_layers=2)


def test_the_placement_sets_weights_tables_and_kv_dtypes():
    """One value decides the dtype of the weights, the RoPE table and every KV spec."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    model = LlamaForCausalLM(config, BACKENDS["exact"], Placement(dtype=torch.bfloat16))
    model.load_weights(weights.items())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos.dtype == torch.bfloat16
    assert {s.dtype for s in model.kv_cache_specs(16).values()} == {"bfloat16"}
    default = LlamaForCausalLM(config, BACKENDS["exact"])
    assert {s.dtype for s in default.kv_cache_specs(16).values()} == {"float32"}
