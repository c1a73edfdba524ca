"""A model's generation config may name several end-of-sequence ids (Llama 3's three, gpt-oss's
<|return|> / <|endoftext|> / <|call|>): the engine stops on every one, as transformers' generate and
vLLM do, not only on the tokenizer's. transformers' greedy output of a tiny random Llama picks the
id: a request stops there ("stop", the id as stop_reason), one with ignore_eos runs its length (and
is that greedy output). A GGUF's end-of-turn / end-of-message ids (tokenizer.ggml.eot_token_id, ...)
stop a request as llama.cpp's end-of-generation set does; one outside the vocabulary is dropped, said."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import LlamaConfig, Olmo2Config

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.test_dense_gguf import write_gguf
from tests.parity import greedy_tokens, reference_outputs

NEW_TOKENS = 8
PROMPT = [3, 14, 15, 92, 65]
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, pad_token_id=None)


def test_every_generation_config_eos_id_stops(tmp_path):
    reference = save_random_model(LlamaConfig(**SIZES, eos_token_id=None), tmp_path)
    free = greedy_tokens(reference_outputs(reference, [PROMPT], NEW_TOKENS))[0]
    at = next(i for i in range(1, NEW_TOKENS) if free[i] not in free[:i])
    primary = next(t for t in range(SIZES["vocab_size"]) if t not in free)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": primary}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [primary, free[at]]}))

    llm = LLM(str(tmp_path), block_size=4, kv_cache_memory="1MiB")
    assert llm.engine.core.loaded.eos_token_ids == (primary, free[at])
    stopped, ignoring = (o.outputs[0] for o in llm.generate(
        [PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=ignore)
                           for ignore in (False, True)], use_tqdm=False))
    assert stopped.token_ids == free[:at + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", free[at])
    assert (ignoring.token_ids, ignoring.finish_reason) == (free, "length")


def test_a_malformed_eos_list_is_named(tmp_path):
    save_random_model(LlamaConfig(**SIZES, eos_token_id=None), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list"):
        load_model(str(tmp_path), BACKENDS["exact"])


def test_a_gguf_end_of_turn_id_stops(tmp_path, monkeypatch):
    reference = save_random_model(Olmo2Config(**SIZES, eos_token_id=None), tmp_path / "hf")
    free = greedy_tokens(reference_outputs(reference, [PROMPT], NEW_TOKENS))[0]
    at = next(i for i in range(1, NEW_TOKENS) if free[i] not in free[:i])
    eos = next(t for t in range(SIZES["vocab_size"]) if t not in free)
    write_gguf(reference, tmp_path / "model.gguf", "olmo2", edit=lambda writer: (
        writer.add_eos_token_id(eos), writer.add_eot_token_id(free[at])))
    monkeypatch.setenv("BLOCKSERVE_CACHE_DIR", str(tmp_path / "cache"))

    llm = LLM(str(tmp_path / "model.gguf"), block_size=4, kv_cache_memory="1MiB")
    assert llm.engine.core.loaded.eos_token_ids == (eos, free[at])
    stopped, ignoring = (o.outputs[0] for o in llm.generate(
        [PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=ignore)
                           for ignore in (False, True)], use_tqdm=False))
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (free[:at + 1], "stop", free[at])
    assert (ignoring.token_ids, ignoring.finish_reason) == (free, "length")


def test_a_gguf_end_of_message_id_outside_the_vocabulary_is_dropped_and_said(tmp_path, caplog):
    reference = save_random_model(Olmo2Config(**SIZES, eos_token_id=None), tmp_path / "hf")
    write_gguf(reference, tmp_path / "model.gguf", "olmo2", edit=lambda writer: (
        writer.add_eos_token_id(2), writer.add_eom_token_id(SIZES["vocab_size"] + 3),
        writer.add_uint32("tokenizer.ggml.fim_sep_token_id", 7)))
    with caplog.at_level(logging.WARNING, logger="blockserve.models.loader"):
        loaded = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    assert loaded.eos_token_ids == (2, 7)
    assert f"eom_token_id {SIZES['vocab_size'] + 3} is outside the vocabulary" in caplog.text
