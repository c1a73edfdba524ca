"""A tiny GPT-OSS checkpoint with MXFP4 experts (the released checkpoints' layout: `*_blocks` and
`*_scales` uint8 tensors, `quantization_config.quant_method: "mxfp4"`) through the real loader.

The experts of test_gpt_oss.py's random model are encoded with the test encoder (mxfp4_encoder.py)
and written in its place; transformers, dequantising that checkpoint on the CPU (Mxfp4Config
dequantize=True), is the reference. The experts stay MXFP4 in memory (their resident bytes are the
file's), prompt logits are within 1e-4 and greedy tokens equal, prefill in chunks and decode.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.mxfp4_encoder import encode_mxfp4
from tests.models.test_gpt_oss import GPT_OSS_CONFIGS, LOGIT_TOLERANCE, NEW_TOKENS
from tests.paged_harness import run_paged
from tests.parity import assert_logits_close, greedy_tokens, reference_logits, reference_outputs
from tests.scenarios import paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECTIONS = ("gate_up_proj", "down_proj")  # transformers' [E, in, out]; MXFP4 holds [E, out, in]


def write_mxfp4_checkpoint(path, config=None) -> dict[str, int]:
    """The random model of `config` (default: test_gpt_oss.py's) at `path`, its experts' projections
    replaced by MXFP4; returns the bytes of each written MXFP4 tensor by name."""
    config = config or GPT_OSS_CONFIGS["gpt_oss"]()
    reference = save_random_model(config, path)
    tensors = {name: t.contiguous() for name, t in reference.state_dict().items()}
    written = {}
    for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
        blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2).double().numpy())
        for suffix, array in (("_blocks", blocks), ("_scales", scales)):
            tensors[name + suffix] = torch.from_numpy(array)
            written[name + suffix] = array.nbytes
    for old in path.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config_json))
    return written


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """(path, MXFP4 tensor bytes by name, prompts, transformers' logits and greedy tokens)."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    written = write_mxfp4_checkpoint(path)
    reference = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.float32).eval()
    prompts = paged_prompts()
    return (path, written, prompts, reference_logits(reference, prompts),
            greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS)))


def test_mxfp4_experts_match_transformers_dequantised(mxfp4_checkpoint):
    path, _, prompts, ref_logits, ref_tokens = mxfp4_checkpoint
    model = load_model(str(path), BACKENDS["exact"]).model
    logits, tokens = run_paged(model, prompts, NEW_TOKENS, chunk=6)
    assert_logits_close(logits, ref_logits, atol=LOGIT_TOLERANCE, rtol=0)
    assert tokens == ref_tokens


def test_the_experts_stay_mxfp4_in_memory(mxfp4_checkpoint):
    path, written, *_ = mxfp4_checkpoint
    model = load_model(str(path), BACKENDS["exact"]).model
    experts = {name: p for name, p in model.named_parameters() if ".mlp.experts." in name and not name.endswith("bias")}
    assert {name: p.dtype for name, p in experts.items()} == {name: torch.uint8 for name in written}
    assert sum(p.nbytes for p in experts.values()) == sum(written.values())
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # the file's bytes, as written
        assert sum(f.get_tensor(name).nbytes for name in written) == sum(written.values())


def test_a_float_tensor_for_packed_blocks_is_named(mxfp4_checkpoint, tmp_path):
    path, written, *_ = mxfp4_checkpoint
    name = next(iter(written))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name].float()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=f"{name.rsplit('.', 1)[0]}.* is packed torch.uint8 data"):
        load_model(str(tmp_path), BACKENDS["exact"])
