"""`blockserve generate` on a tiny random Llama with a word-level tokenizer: a model with a chat
template goes through it by default (the same tokens as LLM.chat), --no-chat-template and a model
without one complete raw (the same as LLM.generate), and stderr says which mode ran."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.cli import CHAT_MODE, RAW_MODE, RAW_NO_TEMPLATE, main
from blockserve.models.random_checkpoint import save_random_model
from tests.benchmark.conftest import SIZES, VOCAB, save_word_tokenizer

PROMPTS = ["w3 w5 w9", "w7"]
ENGINE = ["--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "64"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """{"chat": a model with a chat template, "raw": the same weights without one}."""
    paths = {}
    for kind in ("chat", "raw"):
        path = tmp_path_factory.mktemp(f"tiny-llama-{kind}")
        save_random_model(LlamaConfig(**SIZES), path)
        save_word_tokenizer(path, VOCAB)
        if kind == "raw":
            (path / "chat_template.jinja").unlink(missing_ok=True)
            config = json.loads((path / "tokenizer_config.json").read_text())
            config.pop("chat_template", None)
            (path / "tokenizer_config.json").write_text(json.dumps(config))
        paths[kind] = str(path)
    return paths


def run_cli(capsys, model: str, *flags: str) -> tuple[int, list[dict], list[str]]:
    """(exit status, the JSONL records, stderr's lines) of one `blockserve generate`."""
    code = main(["-q", "generate", "--model", model, *ENGINE, "--max-tokens", str(NEW_TOKENS), "--ignore-eos",
                 "--jsonl", *flags, *PROMPTS])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err.splitlines()


def offline(model: str, chat: bool) -> list[tuple[str, int]]:
    """(text, prompt tokens) per prompt from LLM.chat or LLM.generate on the CLI's engine args."""
    llm = LLM(model, block_size=4, kv_cache_memory="4MiB", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    else:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].text, len(o.prompt_token_ids)) for o in outputs]


def texts(records: list[dict]) -> list[tuple[str, int]]:
    return [(r["text"], r["num_prompt_tokens"]) for r in records]


def test_a_chat_model_goes_through_its_template_by_default(models, capsys):
    code, records, err = run_cli(capsys, models["chat"])
    assert code == 0 and CHAT_MODE in err
    assert [r["prompt"] for r in records] == PROMPTS
    chat, raw = offline(models["chat"], chat=True), offline(models["chat"], chat=False)
    assert texts(records) == chat
    assert [n for _, n in chat] != [n for _, n in raw]  # the template really changed the prompt


def test_chat_template_flag_still_works_and_is_the_default(models, capsys):
    code, records, err = run_cli(capsys, models["chat"], "--chat-template")
    assert code == 0 and CHAT_MODE in err
    assert texts(records) == offline(models["chat"], chat=True)


def test_no_chat_template_completes_raw(models, capsys):
    code, records, err = run_cli(capsys, models["chat"], "--no-chat-template")
    assert code == 0 and RAW_MODE in err
    assert texts(records) == offline(models["chat"], chat=False)


def test_a_model_without_a_template_completes_raw_and_says_so(models, capsys):
    code, records, err = run_cli(capsys, models["raw"])
    assert code == 0 and RAW_NO_TEMPLATE in err
    assert texts(records) == offline(models["raw"], chat=False)


def test_chat_template_flag_on_a_model_without_one_is_an_error(models, capsys):
    code = main(["-q", "generate", "--model", models["raw"], *ENGINE, "--chat-template", *PROMPTS])
    err = capsys.readouterr().err
    assert code == 2 and "no chat template" in err and "drop --chat-template" in err


def test_chat_refuses_a_model_without_a_template(models, capsys):
    assert main(["-q", "chat", "--model", models["raw"], *ENGINE]) == 2
    assert "no chat template" in capsys.readouterr().err
