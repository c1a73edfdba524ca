"""The flat decode loop (models/llama_decode.py) against the module path it stands in for, and the
native stack against the flat loop: the same greedy tokens and bitwise the same logprobs, on a tiny
random Llama (tied embeddings, so every linear the loop calls is exercised) served through the real
engine, and on a tiny K-quant mix GGUF (layers on the file's own blocks beside packed ones)."""

from __future__ import annotations

import gguf
import pytest
import torch
from transformers import LlamaConfig

import blockserve.models.llama as llama
from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.models import llama_decode
from blockserve.models.gguf_block_linear import MAX_ROWS as GGUF_MAX_ROWS, GGUFBlockLinear
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import QuantizedLinear, use_quantized_linears
from blockserve.models.random_checkpoint import save_random_model
from blockserve.native.extension import ISA_ENV, fused_ops, quantized_matmul_ops, why_not_native
from tests.models.test_kquant_gguf import write_kquant_gguf

pytestmark = pytest.mark.skipif(why_not_native() is not None, reason=f"native kernels cannot be built here: {why_not_native()}")

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def generate(path, monkeypatch, flat: bool) -> tuple[list, int]:
    """Three prompts decoding side by side (chunked prefill, then decode-only steps): tokens and
    logprobs, and how many steps the flat loop ran."""
    ran = []

    def counted(*args):
        hidden = llama_decode_layers(*args) if flat else None
        ran.append(hidden is not None)
        return hidden

    llama_decode_layers = llama.decode_layers
    monkeypatch.setattr(llama, "decode_layers", counted)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    llm = LLM(str(path), max_num_batched_tokens=8, block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)
    monkeypatch.setattr(llama, "decode_layers", llama_decode_layers)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], sum(ran)


def greedy_tokens_and_logprobs(llm: LLM, lengths) -> list:
    """Per random prompt of each length (seeded): 12 greedy tokens and their top-2 logprobs."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def test_the_flat_decode_loop_gives_the_module_paths_results(tmp_path, monkeypatch):
    save_random_model(LlamaConfig(**CONFIG), tmp_path)
    flat, flat_steps = generate(tmp_path, monkeypatch, flat=True)
    modules, module_steps = generate(tmp_path, monkeypatch, flat=False)
    assert flat_steps >= 10 and module_steps == 0  # the loop really ran (decode-only steps), and really did not
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(flat, modules):
        assert tokens == want_tokens
        assert [{t: lp.logprob for t, lp in d.items()} for d in logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in want_logprobs]


def test_a_step_with_a_prefill_row_is_left_to_the_module_path(tmp_path, monkeypatch):
    """Steps mixing a prefill chunk with decodes (the first prompt decodes while the third is still
    being prefilled in chunks of 8) are not flat: the loop declines them before touching anything."""
    save_random_model(LlamaConfig(**CONFIG), tmp_path)
    seen = []
    real = llama.decode_layers

    def recorded(layers, norm, x, cos, sin, ctx):
        before = x.clone()
        hidden = real(layers, norm, x, cos, sin, ctx)
        layout = ctx.metadata[0].layout
        seen.append((layout.num_decodes == layout.num_seqs, hidden is not None))
        if hidden is None:
            assert torch.equal(x, before)
        return hidden

    monkeypatch.setattr(llama, "decode_layers", recorded)
    llm = LLM(str(tmp_path), max_num_batched_tokens=8, block_size=4)
    llm.generate([[1, 2, 3], list(range(20, 37))], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert (False, False) in seen and (True, True) in seen
    assert all(flat == all_decodes for all_decodes, flat in seen)


@pytest.mark.slow  # four engines, ~13 s
@pytest.mark.parametrize("activations,num_prompts", [("float32", 3), ("int8", 3), ("int16", 3), ("float32", 24)])
def test_the_native_stack_gives_the_flat_loops_results(tmp_path, monkeypatch, activations, num_prompts):
    """With GGUF blocks on every linear layer, a decode-only step is one native call (DecodeStack):
    the same greedy tokens and bitwise the same logprobs as the flat loop, which runs where the stack
    is switched off. 24 prompts: steps of 24 decodes, which the stack runs where the blocks serve that
    many rows (AVX-512; its decode attention then splits on the task pool too)."""
    reference = save_random_model(LlamaConfig(**CONFIG), tmp_path)
    if (ops := quantized_matmul_ops()) is None or not ops.simd_lanes():
        pytest.skip("the quantized kernel needs native kernels built with AVX-512 or AVX2")
    blocks = [(name, "Q4_1" if "mlp" in name else "Q8_0",
               gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType["Q4_1" if "mlp" in name else "Q8_0"]))
              for name, weight in reference.state_dict().items()
              if name.endswith("proj.weight") and name.startswith("model.layers.")]
    loaded = load_model(str(tmp_path), BACKENDS["exact"])
    assert use_quantized_linears(loaded.model, blocks, activations=activations) == {name for name, _, _ in blocks}
    stacks = []

    def counted(*args):
        stacks.append(real_stack(*args))
        return stacks[-1]

    real_stack = llama_decode.native_stack
    results = []
    lengths = (5, 11, 17) if num_prompts == 3 else range(2, 2 + num_prompts)
    for stack in (counted, lambda *args: None):
        monkeypatch.setattr(llama_decode, "native_stack", stack)
        llm = LLM(loaded, max_num_batched_tokens=8 if num_prompts == 3 else 64, block_size=4)
        results.append(greedy_tokens_and_logprobs(llm, lengths))
        del llm
    max_rows = min(linear.max_rows for linear in loaded.model.modules() if hasattr(linear, "max_rows"))
    if num_prompts <= max_rows:
        assert sum(stack is not None for stack in stacks) >= 10  # the stack really ran
    assert results[0] == results[1]


def test_the_decode_plan_is_made_once_and_reused_every_step(tmp_path, monkeypatch):
    """What never changes between steps (each layer's kernel, caches, KV group) is settled on the
    first decode-only step and kept for the runner's life (ForwardContext.memo), not redone per step."""
    save_random_model(LlamaConfig(**CONFIG), tmp_path)
    made, ran = [], []
    real_plan, real_layers = llama_decode._make_plan, llama.decode_layers
    monkeypatch.setattr(llama_decode, "_make_plan", lambda *args: made.append(1) or real_plan(*args))

    def counted(*args):
        hidden = real_layers(*args)
        ran.append(hidden is not None)
        return hidden

    monkeypatch.setattr(llama, "decode_layers", counted)
    llm = LLM(str(tmp_path), max_num_batched_tokens=8, block_size=4)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert sum(ran) >= 10 and len(made) == 1


def test_the_native_stack_refuses_unknown_activations():
    if (ops := fused_ops()) is None:
        pytest.skip(f"no native kernels: {why_not_native()}")
    with pytest.raises(RuntimeError, match="activations must be float32, int8 or int16, not 'int4'"):
        ops.DecodeStack([], [torch.ones(4)], [1e-6], "int4", 1, 1.0)
    with pytest.raises(RuntimeError, match="no block kernel for GGUF format 'Q3_0'"):
        ops.DecodeStack.Linear.gguf_segments([(torch.zeros(4, 18, dtype=torch.uint8), "Q3_0")], None)


# k8v4 (int8 keys, the kernel-level tests' too) is slow: two more engines, ~4 s on 2 quiet cores
@pytest.mark.parametrize("kv_cache_dtype", ["int4", pytest.param("k8v4", marks=pytest.mark.slow)])
def test_the_native_stack_over_a_rotated_4bit_cache_gives_the_per_layer_paths_results(tmp_path, monkeypatch,
                                                                                        kv_cache_dtype):
    """int4 and k8v4 caches (rotated 4-bit keys and values, int8 keys over them): a decode-only step is
    one native call (DecodeStack, which rotates, quantises and un-rotates in C++) and gives the same
    greedy tokens and bitwise the same logprobs as the per-layer path (the fused call switched off:
    kv_quant's PyTorch rotation and write around the backend's decode kernel). Head size 64: the
    kernel's intrinsics path."""
    reference = save_random_model(LlamaConfig(**{**CONFIG, "head_dim": 64}), tmp_path)
    if (ops := quantized_matmul_ops()) is None or not ops.simd_lanes():
        pytest.skip("the quantized kernel needs native kernels built with AVX-512 or AVX2")
    blocks = [(name, "Q8_0", gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0))
              for name, weight in reference.state_dict().items()
              if name.endswith("proj.weight") and name.startswith("model.layers.")]
    loaded = load_model(str(tmp_path), BACKENDS["exact"])
    use_quantized_linears(loaded.model, blocks)
    stacks = []
    real_stack = llama_decode.native_stack
    monkeypatch.setattr(llama_decode, "native_stack", lambda *args: stacks.append(real_stack(*args)) or stacks[-1])
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(RotaryDecode, "fixed", lambda self, cache, dtype: None)
        llm = LLM(loaded, max_num_batched_tokens=8, block_size=4, kv_cache_dtype=kv_cache_dtype)
        results.append(greedy_tokens_and_logprobs(llm, (5, 11, 17)))
        del llm
    assert sum(stack is not None for stack in stacks) >= 10  # the stack really ran over the 4-bit cache
    assert results[0] == results[1]


# A Q4_K_M kind of mix (test_kquant_gguf.py: Q4_K, a Q6_K attn_v, a Q5_0 ffn_down; qwen2: q/k/v biases)
# with layer 1's o and gate/up in Q8_0: per layer GGUFBlockLinears of three segments (qkv), two
# (gate_up), one (o, down) beside QuantizedLinears on packed blocks.
MIXED = {"blk.1.attn_output.weight": "Q8_0", "blk.1.ffn_gate.weight": "Q8_0", "blk.1.ffn_up.weight": "Q8_0"}


def load_mixed(tmp_path, activations: str = "float32"):
    path = tmp_path / "model.gguf"
    write_kquant_gguf(path, "qwen2", formats=MIXED)
    if (ops := quantized_matmul_ops()) is None or not ops.simd_lanes():
        pytest.skip("the block kernels need native kernels built with AVX-512 or AVX2")
    loaded = load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"),
                        quantized_activations=activations, quantized_max_rows=None if activations == "int8" else 8)
    linears = [m for layer in loaded.model.model.layers for m in layer.modules()
               if isinstance(m, (QuantizedLinear, GGUFBlockLinear))]
    assert len(linears) == 8 and {type(m) for m in linears} == {QuantizedLinear, GGUFBlockLinear}
    assert sorted(len(m.segments) for m in linears if isinstance(m, GGUFBlockLinear)) == [1, 1, 1, 2, 3, 3]
    return loaded


@pytest.mark.parametrize("activations,isa", [("float32", "native"), ("int8", "native"),
                                             pytest.param("int16", "native", marks=pytest.mark.slow),
                                             pytest.param("float32", "avx2", marks=pytest.mark.slow),
                                             pytest.param("int8", "avx2", marks=pytest.mark.slow)])
def test_the_native_stack_over_a_kquant_mix_gives_the_flat_loops_results(tmp_path, monkeypatch, activations, isa):
    """Layers on the file's own blocks (GGUFBlockLinear: gguf_matmul, gguf_matmul_int8 for int8, x
    rounded then gguf_matmul for int16) mixed with packed ones: a decode-only step is one native call
    (DecodeStack) with the same greedy tokens and bitwise the same logprobs as the flat loop, up to
    the rows every layer's kernel serves (the float kernel's MAX_ROWS; int8: every row count)."""
    if isa == "avx2":
        monkeypatch.setenv(ISA_ENV, "avx2")
    loaded = load_mixed(tmp_path, activations)
    stacks = []
    real_stack = llama_decode.native_stack
    results = []
    for stack in (lambda *args: stacks.append(real_stack(*args)) or stacks[-1], lambda *args: None):
        monkeypatch.setattr(llama_decode, "native_stack", stack)
        llm = LLM(loaded, max_num_batched_tokens=8, block_size=4)
        results.append(greedy_tokens_and_logprobs(llm, (5, 11, 17)))
        del llm
    assert sum(stack is not None for stack in stacks) >= 10  # the stack really ran
    assert results[0] == results[1]
    model = loaded.model.model
    beyond = real_stack(model.layers, model.norm, GGUF_MAX_ROWS + 1)
    assert (beyond is not None) == (activations == "int8")  # past MAX_ROWS the float kernels' layers tile a GEMM


def test_tensor_parallel_layers_are_left_to_the_flat_loop(tmp_path):
    """A shard of a tensor-parallel model (a row-parallel GGUFBlockLinear's all-reduce, or a sharded
    QuantizedLinear) has no native stack: the flat loop runs its layers' own forward."""
    model = load_mixed(tmp_path).model.model
    assert llama_decode._build_stack(model.layers, model.norm) is not None
    down = model.layers[0].mlp.down_proj  # Q5_0: a GGUFBlockLinear
    down.tp = object()
    assert llama_decode._build_stack(model.layers, model.norm) is None
    down.tp = None
    o_proj = model.layers[1].self_attn.o_proj  # Q8_0: a QuantizedLinear
    assert isinstance(o_proj, QuantizedLinear)
    o_proj.sharded = True
    assert llama_decode._build_stack(model.layers, model.norm) is None
