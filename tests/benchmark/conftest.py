"""A tiny random Llama with a word-level tokenizer and a chat template, so the fixed chat workload
renders on it and a served stream carries text for every token."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from blockserve.models.random_checkpoint import save_random_model

VOCAB = 512
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def save_word_tokenizer(path, vocab_size: int) -> None:
    """Token i is the word `w{i}` (any other word is w0); decoding joins words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-bench")
    save_random_model(LlamaConfig(**SIZES), path)
    save_word_tokenizer(path, VOCAB)
    return str(path)
