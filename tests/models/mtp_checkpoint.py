"""Tiny random checkpoints with a multi-token-prediction layer, named as the real checkpoints name it,
and an independent torch reference of that layer's drafting (transformers' decoder layer for the
block, the rest written out here from the raw weights).

    deepseek_v3   model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}
                  and the decoder block (MLA, MoE with per-expert weights), L = num_hidden_layers
    qwen3_next    mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm} and mtp.layers.0.* (gated
                  full attention, sparse MoE with per-expert weights)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model
from tests.models.conftest import MLA_CONFIGS, STATE_CONFIGS


@dataclass
class MTPReference:
    """The saved target (transformers), the MTP block (a transformers decoder layer) and the MTP
    layer's other weights by checkpoint-free name; `family` picks the combination rule."""

    family: str
    target: nn.Module
    block: nn.Module
    weights: dict[str, torch.Tensor]

    def target_states(self, token_ids: list[int]) -> torch.Tensor:
        """The target's final (normalised) hidden states of `token_ids` [n, hidden]."""
        with torch.no_grad():
            return self.target.model(torch.tensor([token_ids])).last_hidden_state[0]

    def logits(self, row_tokens: list[int], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions 0.. of (token, hidden state) -> (each row's next-token logits, its chained state)."""
        w, n = self.weights, len(row_tokens)
        with torch.no_grad():
            emb = self.target.model.embed_tokens(torch.tensor(row_tokens))
            if self.family == "deepseek_v3":
                x = torch.cat([_rms(emb, w["enorm"]), _rms(states, w["hnorm"])], -1) @ w["eh_proj"].T
            else:
                x = torch.cat([_rms(emb, 1 + w["pre_fc_norm_embedding"]),
                               _rms(states, 1 + w["pre_fc_norm_hidden"])], -1) @ w["fc"].T
            positions = torch.arange(n)[None]
            cos_sin = self.target.model.rotary_emb(x[None], positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self.block(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
            out = (out[0] if isinstance(out, tuple) else out)[0]
            if self.family == "deepseek_v3":
                return _rms(out, w["shared_head.norm"]) @ w["shared_head.head"].T, out
            chained = _rms(out, 1 + w["norm"])
            return self.target.lm_head(chained), chained

    def drafts(self, token_ids: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The k greedy drafts after `token_ids` and each one's logits, chaining the layer on its own states."""
        states = self.target_states(token_ids[:-1])
        rows, drafts, all_logits = list(token_ids[1:]), [], []
        for _ in range(k):
            logits, chained = self.logits(rows, states)
            all_logits.append(logits[-1])
            drafts.append(int(logits[-1].argmax()))
            rows.append(drafts[-1])
            states = torch.cat([states, chained[-1:]])
        return drafts, all_logits


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _randomise(module: nn.Module) -> None:
    """As random_checkpoint does: norms near 1, the rest N(0, 0.2); a routing bias N(0, 0.1)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
        for name, buffer in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts as the released checkpoints store them: experts.{e}.{gate,up,down}_proj."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            base, half = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{base}{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor.clone()
    return out


def save_with_mtp(family: str, path: Path, with_mtp_weights: bool = True) -> MTPReference:
    """A tiny random `family` checkpoint at `path` whose safetensors also hold a random MTP layer."""
    if family == "deepseek_v3":
        config = MLA_CONFIGS[family]()
        config.num_nextn_predict_layers = 1
        target = save_random_hybrid(config, path)
    else:
        config = STATE_CONFIGS[family]()
        target = save_random_model(config, path)
    block_config = copy.deepcopy(config)
    block_config._attn_implementation = "eager"
    torch.manual_seed(7)
    hidden, vocab = config.hidden_size, config.vocab_size
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        block = DeepseekV3DecoderLayer(block_config, config.num_hidden_layers)  # past first_k_dense_replace: MoE
        shapes = {"enorm": (hidden,), "hnorm": (hidden,), "eh_proj": (hidden, 2 * hidden),
                  "shared_head.norm": (hidden,), "shared_head.head": (vocab, hidden)}
        prefix, block_prefix = f"model.layers.{config.num_hidden_layers}.", f"model.layers.{config.num_hidden_layers}."
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

        block_config.mlp_only_layers = []
        full = block_config.layer_types.index("full_attention")
        block = Qwen3NextDecoderLayer(block_config, full)  # gated full attention, sparse MoE
        shapes = {"pre_fc_norm_embedding": (hidden,), "pre_fc_norm_hidden": (hidden,), "fc": (hidden, 2 * hidden),
                  "norm": (hidden,)}
        prefix, block_prefix = "mtp.", "mtp.layers.0."
    _randomise(block)
    block.eval()
    weights = {}
    for name, shape in shapes.items():
        weights[name] = (1 + 0.1 * torch.randn(shape)) if "norm" in name else torch.randn(shape) * 0.2
    if family == "qwen3_next":  # offset norms: (1 + weight) scales
        weights = {n: (w - 1 if "norm" in n else w) for n, w in weights.items()}
    if with_mtp_weights:
        file = Path(path) / "model.safetensors"
        tensors = load_file(file)
        tensors |= {f"{block_prefix}{n}": t for n, t in _per_expert(block.state_dict()).items()}
        tensors |= {f"{prefix}{n}.weight": t.contiguous() for n, t in weights.items()}
        if family == "deepseek_v3":  # the released checkpoint repeats the embedding in the MTP layer
            tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, file, metadata={"format": "pt"})
    return MTPReference(family, target, block, weights)


def make_self_predicting(path: Path) -> None:
    """Rewrite a `save_with_mtp("deepseek_v3", path)` checkpoint so that its MTP layer drafts the target's
    own greedy tokens: every decoder layer (the target's and the MTP block) adds nothing (o_proj and
    every down projection zero), so the target's next token is f(its current token), f(x) = argmax
    lm_head(norm(embed(x))); the MTP layer passes the embedding half through (eh_proj = [I | 0], enorm =
    the target's final norm) to the target's lm_head (shared_head.head), so it predicts f(x[t+1]) =
    x[t+2], and likewise f(d) after a draft d."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    layer = next(n for n in tensors if n.endswith(".eh_proj.weight")).removesuffix("eh_proj.weight")
    hidden = tensors["model.norm.weight"].shape[0]
    tensors[f"{layer}eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors[f"{layer}enorm.weight"] = tensors["model.norm.weight"].clone()
    tensors[f"{layer}shared_head.norm.weight"] = torch.ones(hidden)
    tensors[f"{layer}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
