"""A GGUF Llama / Mixtral / Mistral / Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE / Phi-3 file's config and tokenizer
(byte-level BPE or SentencePiece) read from its metadata without transformers (models/gguf_config.py,
models/gguf_tokenizer.py, models/gguf_sentencepiece.py, models/chat_template.py) equal what
transformers builds from the same file: every config attribute the models read, the tokenizer's serialisation, its ids both ways, and
the chat template's rendering (the bundled SmolLM2 model's, and a Qwen2-style template with tools and
reasoning in a tiny file); `blockserve generate` (on a Llama with a SentencePiece vocabulary) and
`serve` (on a Qwen2) never import transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import pytest
from transformers import AutoTokenizer

from blockserve.models import loader
from blockserve.models.default_model import default_model_path
from blockserve.models.gguf_config import GGUFConfig, gguf_config
from blockserve.models.gguf_tokenizer import GGUFTokenizer
from blockserve.models.random_checkpoint import save_random_model
from tests.models.test_dense_gguf import DENSE_GGUF_CONFIGS
from tests.models.test_dense_gguf import write_gguf as write_dense_gguf
from tests.models.test_gguf_sentencepiece import add_spm_vocabulary
from tests.models.test_kquant_gguf import write_kquant_gguf
from tests.models.test_moe_families import MOE_CONFIGS
from tests.models.test_moe_gguf import write_gguf as write_moe_gguf
from tests.models.test_moe_gguf_blocks import write_qwen3_moe_gguf

# what the model classes, the engine and the loader read of a config (directly or by getattr)
READ = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
        "attention_bias", "mlp_bias", "qkv_bias", "sliding_window", "layer_types", "use_sliding_window",
        "no_rope_layers", "quantization_config", "partial_rotary_factor", "attention_multiplier", "logits_scaling",
        "embedding_multiplier", "residual_multiplier", "final_logit_softcapping", "attn_logit_softcapping",
        "query_pre_attn_scalar", "num_local_experts", "rope_interleave", "use_bidirectional_attention",
        "rope_freq_divisors", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")
MISSING = object()

QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages if message['role'] != 'system' %}{% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message.get('content', '') }}{% if message.tool_calls is defined %}{% for call in message.tool_calls %}
<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}
{{- '' if ns.turns else raise_exception('no turns') }}{{ eos_token }}"""

CHATS = [
    [{"role": "user", "content": "Hello, who are you? ünïcödé 数字 123456"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning": "greet back"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "sunny"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TEXTS = ["Hello, world!", "  leading spaces\n\nnew lines\t tabs", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 数字 😀",
         "1234567 numbers 3.14159", "", "t1t2 t10<|endoftext|>t4<think>x"]


def rewrite_gguf(source, path, arch: str, add_vocabulary) -> None:
    """`source`'s hyperparameters (renamed to `arch`'s keys) and tensors written to `path` as an `arch`
    file, its vocabulary replaced by what `add_vocabulary(writer)` adds."""
    reader = gguf.GGUFReader(source)
    source_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture", "tokenizer.")):
            continue
        kind = field.types[0]
        name = f"{arch}.{field.name.removeprefix(source_arch + '.')}" if field.name.startswith(source_arch + ".") \
            else field.name
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    add_vocabulary(writer)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_qwen_vocabulary(writer: gguf.GGUFWriter) -> None:
    """A byte-level vocabulary of 512 real control tokens, merges and QWEN_TEMPLATE."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    pieces = ["t", "0", "1", "2", "t1", "t2", "t10"]
    tokens = specials + pieces + [f"w{i}" for i in range(len(specials) + len(pieces), 512)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED]
                           + [gguf.TokenType.NORMAL] * (512 - 4))
    writer.add_token_merges(["t 1", "t 2", "t1 0"])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    write_kquant_gguf(folder / "llama.gguf", "llama")
    write_kquant_gguf(folder / "qwen2-plain.gguf", "qwen2")
    rewrite_gguf(folder / "qwen2-plain.gguf", folder / "qwen2.gguf", "qwen2", add_qwen_vocabulary)
    # Llama 2's kind: a SentencePiece vocabulary (scores, byte tokens) of the model's 512 rows
    rewrite_gguf(folder / "llama.gguf", folder / "llama-spm.gguf", "llama", lambda w: add_spm_vocabulary(w, 512))
    # config and tokenizer only (the tensors are Llama's): Mistral's file with a SentencePiece vocabulary,
    # Qwen3's with a byte-level one
    rewrite_gguf(folder / "llama.gguf", folder / "mistral.gguf", "mistral",
                 lambda w: add_spm_vocabulary(w, 512, add_bos_token=True, eos_token_id=510))
    rewrite_gguf(folder / "llama.gguf", folder / "qwen3.gguf", "qwen3", add_qwen_vocabulary)
    # Phi-3 as llama.cpp's converter writes it (sliding window; Phi-4-mini's partial rotary LongRoPE),
    # and with Phi-3's SentencePiece vocabulary
    for name in ("phi3", "phi3-longrope"):
        write_dense_gguf(save_random_model(DENSE_GGUF_CONFIGS[name](), folder / f"{name}-hf"), folder / f"{name}.gguf",
                         name)
    rewrite_gguf(folder / "phi3.gguf", folder / "phi3-spm.gguf", "phi3", lambda w: add_spm_vocabulary(w, 512))
    write_qwen3_moe_gguf(folder / "qwen3moe.gguf")
    write_moe_gguf(save_random_model(MOE_CONFIGS["mixtral"](), folder / "mixtral-hf"), folder / "mixtral-plain.gguf",
                   "llama")
    rewrite_gguf(folder / "mixtral-plain.gguf", folder / "mixtral.gguf", "llama", lambda w: add_spm_vocabulary(w, 512))
    qwen2_moe = MOE_CONFIGS["qwen2_moe"]()
    qwen2_moe.mlp_only_layers, qwen2_moe.decoder_sparse_step = [], 1  # llama.cpp's graph: every layer MoE
    write_moe_gguf(save_random_model(qwen2_moe, folder / "qwen2moe-hf"), folder / "qwen2moe.gguf", "qwen2moe")
    return {"smollm2": default_model_path(), "phi3-longrope": folder / "phi3-longrope.gguf",
            **{name: folder / f"{name}.gguf" for name in NATIVE_FILES[1:]}}


NATIVE_FILES = ("smollm2", "llama", "qwen2", "llama-spm", "mistral", "qwen3", "phi3", "phi3-spm", "qwen3moe", "mixtral",
                "qwen2moe")


@pytest.mark.parametrize("name", NATIVE_FILES)
def test_config_equals_transformers(files, name):
    reader = loader._gguf_reader(files[name])
    arch = reader.fields["general.architecture"].contents()
    assert loader.native_gguf(reader, arch)
    ours, theirs = gguf_config(reader, arch), loader._gguf_config(reader, arch)
    assert isinstance(ours, GGUFConfig)
    for attribute in READ:
        assert getattr(ours, attribute, MISSING) == getattr(theirs, attribute, MISSING), attribute
    assert {k: v for k, v in ours.to_dict().items()} == {k: getattr(theirs, k) for k in ours.to_dict()}
    with pytest.raises(AttributeError):
        ours.hidden_size = 1  # frozen


def test_configs_left_to_transformers(files, tmp_path):
    """A Phi-3 with LongRoPE (its rotary frequencies computed by transformers' functions from the
    config) and a Qwen2 with experts (a Qwen2-MoE written as "qwen2") keep transformers' config:
    native_gguf says no, and gguf_config refuses them by name rather than giving a partial config."""
    reader = loader._gguf_reader(files["phi3-longrope"])
    assert not loader.native_gguf(reader, "phi3")
    with pytest.raises(ValueError, match="read through transformers"):
        gguf_config(reader, "phi3")
    rewrite_gguf(files["qwen2"], tmp_path / "experts.gguf", "qwen2",
                 lambda w: (add_qwen_vocabulary(w), w.add_expert_count(4)))
    reader = loader._gguf_reader(tmp_path / "experts.gguf")
    assert not loader.native_gguf(reader, "qwen2")
    with pytest.raises(ValueError, match="read through transformers"):
        gguf_config(reader, "qwen2")


@pytest.fixture(scope="module")
def tokenizers(files, request):
    """name -> (ours, transformers'), each built once (SmolLM2's: the session's, conftest.py)."""
    built = {}

    def both(name: str):
        if name not in built:
            path = files[name]
            theirs = request.getfixturevalue("smollm2_gguf_tokenizer") if name == "smollm2" else \
                AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
            built[name] = (GGUFTokenizer(loader._gguf_reader(path)), theirs)
        return built[name]
    return both


@pytest.mark.parametrize("name", NATIVE_FILES)
def test_tokenizer_equals_transformers(tokenizers, name):
    ours, theirs = tokenizers(name)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.eos_token_id, ours.bos_token_id, ours.chat_template) == \
        (theirs.eos_token_id, theirs.bos_token_id, theirs.chat_template)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["smollm2", "qwen2"])
def test_chat_template_renders_as_transformers(tokenizers, name):
    ours, theirs = tokenizers(name)
    cases = [dict(add_generation_prompt=g) for g in (True, False)]
    if name == "qwen2":
        cases += [dict(add_generation_prompt=True, tools=TOOLS), dict(add_generation_prompt=True, enable_thinking=False)]
    for chat in CHATS:
        for case in cases:
            try:
                want = theirs.apply_chat_template(chat, tokenize=False, **case)
            except Exception as error:  # the template fails on it (SmolLM2's on a message without content)
                with pytest.raises(type(error)):
                    ours.apply_chat_template(chat, tokenize=False, **case)
                continue
            text = ours.apply_chat_template(chat, tokenize=False, **case)
            assert text == want, (chat, case)
            ids = ours.apply_chat_template(chat, tokenize=True, **case)
            assert ids == list(theirs.apply_chat_template(chat, tokenize=True, return_dict=False, **case))
    if name == "qwen2":
        with pytest.raises(Exception, match="no turns"):  # the template's raise_exception
            ours.apply_chat_template([{"role": "system", "content": "only"}])
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template(CHATS[0], continue_final_message=True)


def test_generate_on_a_gguf_never_imports_transformers(files, tmp_path):
    """`blockserve generate --model x.gguf` on a Llama with a SentencePiece vocabulary in a fresh
    process: transformers is not in sys.modules at the end, nothing is written to the cache but
    the row crossover, and the garbage collector, paused while the engine imports and loads, is on."""
    code = ("import gc, sys, json\nfrom blockserve.cli import main\n"
            "rc = main(['generate', '--model', sys.argv[1], '--max-tokens', '6', '--max-model-len', '128',"
            " '--kv-cache-memory', '8MiB', '--num-threads', '1', '--jsonl', 'Hello'])\n"
            "print(json.dumps({'rc': rc, 'transformers': sorted(m for m in sys.modules if m.split('.')[0] == "
            "'transformers'), 'gc': gc.isenabled()}))")
    env = {**os.environ, "BLOCKSERVE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(files["llama-spm"])], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert lines[-1] == {"rc": 0, "transformers": [], "gc": True}
    assert lines[0]["prompt"] == "Hello" and lines[0]["num_generated_tokens"] == 6
    cache = tmp_path / "cache"
    assert not cache.exists() or {p.name for p in cache.iterdir()} <= {"row-crossover"}


SERVE = """
import gc, json, os, sys, threading, time, urllib.request
from blockserve.cli import main

url = "http://127.0.0.1:" + sys.argv[2]

def probe():
    try:
        for _ in range(3000):
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        request = urllib.request.Request(url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
        print(json.dumps({"tokens": answer["usage"]["completion_tokens"],
                          "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                          "gc": gc.isenabled(), "frozen": gc.get_freeze_count() > 0}))
    finally:
        sys.stdout.flush()
        os._exit(0)

threading.Thread(target=probe, daemon=True).start()
main(["serve", "--model", sys.argv[1], "--port", sys.argv[2], "--max-model-len", "128", "--kv-cache-memory", "8MiB",
      "--num-threads", "1"])
"""


def test_serve_on_a_gguf_never_imports_transformers(files, tmp_path):
    """`blockserve serve --model x.gguf` in a fresh process, up to answering a chat completion
    (the chat template, the Hermes tool probe, the structured-output compiler's module): transformers
    is not in sys.modules; the garbage collector, paused while the server imports and loads, is on,
    with the start-up heap frozen."""
    from tests.server_process import free_port

    env = {**os.environ, "BLOCKSERVE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SERVE, str(files["qwen2"]), str(free_port())], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"tokens": 4, "transformers": [], "gc": True,
                                                                "frozen": True}, done.stderr[-3000:]


def test_the_pre_tokenizer_splits_are_transformers():
    """Each tokenizer.ggml.pre value transformers' GGUF loader splits text for, split alike (a file of
    any other value gets GPT-2's byte-level split in both)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from blockserve.models.gguf_tokenizer import SPLITS

    assert SPLITS == GGUF_PRE_TOKENIZER_SPLITS


@pytest.mark.parametrize("add_bos, add_eos, bos, eos, unk", [
    (None, None, None, None, None), (True, None, 1, 2, None), (True, True, 1, 2, 0), (None, True, None, 2, None),
    (False, False, 1, 2, 0), (True, None, None, 2, None)])
def test_special_tokens_and_ends_as_transformers(tmp_path, add_bos, add_eos, bos, eos, unk):
    """Files setting or leaving out BOS / EOS / UNK ids and add_bos / add_eos_token: the same added
    tokens (NORMAL tokens named special become special; "<|endoftext|>", transformers' GPT-2
    default, is added past the vocabulary) and the same BOS / EOS around an encoding."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["t", "1", "2", "t1", "t2", " ", "Ġ", "Ġt"])
    writer.add_token_types([gguf.TokenType.NORMAL] * 8)
    writer.add_token_merges(["t 1", "t 2", "Ġ t"])
    for value, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id), (unk, writer.add_unk_token_id),
                       (add_bos, writer.add_add_bos_token), (add_eos, writer.add_add_eos_token)):
        if value is not None:
            add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = GGUFTokenizer(loader._gguf_reader(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens_map == theirs.special_tokens_map
    for text in ("t1 t2", "t2t1", ""):
        assert ours.encode(text) == theirs.encode(text), text


def test_special_token_ids_outside_the_vocabulary_are_dropped(tmp_path, caplog):
    """A BOS / EOS / UNK / PAD id past the vocabulary is dropped with a warning naming its key, by the
    tokenizer and the config alike (as the loader drops such end-of-generation ids), never an
    IndexError at load; the ids inside it are kept."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_block_count, 1), (writer.add_head_count, 4)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["t", "1", "2", "t1", "t2", " ", "Ġ", "Ġt"])
    writer.add_token_types([gguf.TokenType.NORMAL] * 8)
    writer.add_token_merges(["t 1", "t 2", "Ġ t"])
    writer.add_bos_token_id(10**6)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(8)
    writer.add_pad_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level("WARNING"):
        tokenizer = GGUFTokenizer(loader._gguf_reader(path))
        config = gguf_config(loader._gguf_reader(path), "llama")
    assert (tokenizer.bos_token, tokenizer.eos_token_id, tokenizer.unk_token, tokenizer.pad_token_id) == \
        (None, 2, None, 1)
    assert tokenizer.encode("t") == [0]  # add_bos_token without a BOS adds nothing
    # the config as if the file had no BOS id: the family's default (transformers' LlamaConfig's, 1)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 1)
    warned = [r.getMessage() for r in caplog.records]
    assert sum("tokenizer.ggml.bos_token_id 1000000 is outside the vocabulary (8 tokens)" in m for m in warned) == 2
    assert any("tokenizer.ggml.unknown_token_id 8 is outside" in m for m in warned)


def test_the_loaders_gguf_tokenizer_is_the_front_ends(files, tmp_path):
    """loader.gguf_tokenizer, which a front end's load_tokenizer uses: the metadata's tokenizer for a
    file the loader reads natively, None for one whose tokenizer goes through transformers."""
    from blockserve.engine.config import EngineConfig
    from blockserve.engine.tokenizer import load_tokenizer

    ours = loader.gguf_tokenizer(files["qwen2"])
    assert isinstance(ours, GGUFTokenizer)
    front = load_tokenizer(EngineConfig(model=str(files["qwen2"])))
    assert isinstance(front, GGUFTokenizer) and front.encode("t10 t2") == ours.encode("t10 t2")
    path = tmp_path / "unigram.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("t5")  # unigram: transformers builds it
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁t"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert loader.gguf_tokenizer(path) is None
    with pytest.raises(ValueError, match="could not read GGUF file"):
        loader.gguf_tokenizer(tmp_path / "unigram.gguf.missing")
