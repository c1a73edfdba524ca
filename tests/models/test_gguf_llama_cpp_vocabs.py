"""Real vocabularies: llama.cpp's own vocabulary-only GGUF files (models/ggml-vocab-*.gguf in its
source tree, with the test strings `.inp` and the ids llama.cpp expects `.out` beside each), found
in the peer build's source (benchmarks/peers/build_llama_cpp.sh; $BLOCKSERVE_PEERS_CACHE or
~/.cache/blockserve-peers). GGUFTokenizer's serialisation equals transformers' GGUF loader's, and so
do the ids and decodings of every test string; against llama.cpp's expected ids, Phi-3's and the
byte-level vocabularies agree, while Llama 2's SentencePiece vocabulary differs exactly on strings
that start with a space (transformers' Metaspace prepends "▁" only where the text does not start
with one; sentencepiece and llama.cpp always do), which blockserve follows transformers in.
Skipped where the peer build's source is absent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from blockserve.models import loader
from blockserve.models.gguf_tokenizer import GGUFTokenizer

pytestmark = pytest.mark.peer_source

PEERS = Path(os.environ.get("BLOCKSERVE_PEERS_CACHE", Path.home() / ".cache" / "blockserve-peers"))
SOURCES = sorted(PEERS.glob("llama.cpp-*/src/models"))
# vocabulary -> whether its ids equal llama.cpp's expected ones on every test string (Llama 3's
# byte-level vocabulary differs on one, where transformers and blockserve agree)
VOCABULARIES = {"ggml-vocab-llama-spm.gguf": False, "ggml-vocab-phi-3.gguf": True, "ggml-vocab-qwen2.gguf": True,
                "ggml-vocab-llama-bpe.gguf": False}


@pytest.mark.skipif(not SOURCES, reason=f"no llama.cpp source under {PEERS} (benchmarks/peers/build_llama_cpp.sh)")
@pytest.mark.parametrize("name", sorted(VOCABULARIES))
def test_llama_cpp_vocabularies_tokenize_as_transformers(name):
    path = SOURCES[-1] / name
    ours = GGUFTokenizer(loader._gguf_reader(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    texts = Path(f"{path}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = [[int(i) for i in line.split()] for line in Path(f"{path}.out").read_text().split("\n")]
    differ = []
    for text, want in zip(texts, expected):
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
        if ours.encode(text, add_special_tokens=False) != want:
            differ.append(text)
    if VOCABULARIES[name]:
        assert differ == []
    elif name == "ggml-vocab-llama-spm.gguf":
        assert differ and all(text.startswith(" ") for text in differ), differ
