"""A GGUF SentencePiece vocabulary (tokenizer.ggml.model "llama": scores, byte tokens <0x00>..<0xFF>,
control and user-defined tokens) built without transformers (models/gguf_sentencepiece.py through
GGUFTokenizer) equals transformers' GGUF loader's tokenizer of the same file: its serialisation, its
special tokens, the ids of varied text (unicode, emoji, spaces leading, trailing and repeated, digits,
characters only bytes spell, special tokens) with and without BOS / EOS, and their decoding with and
without the special tokens; for Llama / Mistral (Metaspace) and Phi-3 (its normaliser), files that set
or leave out the special ids and add_bos / add_eos / add_space_prefix, or lack "<s>" / "</s>" / "<unk>"."""

from __future__ import annotations

import json
from collections import Counter

import gguf
import pytest
from transformers import AutoTokenizer

from blockserve.models import loader
from blockserve.models.gguf_sentencepiece import spm_merges
from blockserve.models.gguf_tokenizer import GGUFTokenizer, native_vocabulary

CORPUS = ("the quick brown fox jumps over the lazy dog while the other dogs watch the fox; "
          "hello world, hello there, the world is wide and the sea is deep; "
          "numbers 1234567890 and 3.14159 are in the text too, as are tabs\tand lines\n"
          "a tokenizer splits sentences into pieces, merging frequent neighbours into longer pieces until "
          "its vocabulary is full; rare characters fall back to bytes, common words become single pieces, "
          "and everything between keeps its spelling: parsing, serving, streaming, scheduling, batching")
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # control
USER = ["<think>"]  # user-defined
TEXTS = ["Hello world", "the quick brown fox", "  leading spaces", "trailing spaces  ", "a  b   c    d",
         "\ttabs\nnew lines\n\n", "1234567 3.14159", "ünïcödé 数字 Ωß∂", "emoji 😀👍🏽 done", "", " ", "\n",
         "<s>the</s><unk>", "<|im_start|>user\nhi<|im_end|>", "<think>the fox</think>", "the<|im_end|> dog",
         "<0x41> is not a byte"]


def bpe_pieces(count: int) -> list[str]:
    """`count` pieces learnt from CORPUS as SentencePiece's BPE trainer learns them: its characters
    ("▁" for a space, starting each word), then the most frequent adjacent pair of pieces merged,
    again and again, each merge a new piece (so every piece's halves are pieces: merges apply)."""
    words = Counter(tuple("▁" + word) for word in CORPUS.split(" ") if word)
    pieces = sorted({char for word in words for char in word}) + ["▁▁", "▁▁▁▁"]
    while len(pieces) < count:
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        assert pairs, f"CORPUS yields {len(pieces)} pieces, not {count}"
        (left, right), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(left + right)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == (left, right):
                    out.append(left + right)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return pieces[:count]


def spm_vocabulary(size: int, bos: str = "<s>", eos: str = "</s>", unk: str = "<unk>") -> tuple[list, list, list]:
    """(tokens, scores, token types) of a SentencePiece vocabulary of `size` tokens as llama.cpp's
    converter writes one: unk, bos, eos; the 256 byte tokens; BPE pieces of CORPUS (bpe_pieces),
    scored by merge order; control and user-defined tokens."""
    pieces = bpe_pieces(size - 3 - 256 - len(SPECIALS) - len(USER))
    tokens = [unk, bos, eos] + [f"<0x{b:02X}>" for b in range(256)] + pieces + SPECIALS + USER
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * (len(SPECIALS) + len(USER))
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
        [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces) + \
        [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.USER_DEFINED] * len(USER)
    return tokens, scores, kinds


def add_spm_vocabulary(writer: gguf.GGUFWriter, size: int, names: tuple[str, str, str] = ("<s>", "</s>", "<unk>"),
                       **metadata) -> None:
    """spm_vocabulary(size) into `writer`, with bos/eos/unk ids 1, 2, 0 unless `metadata` (the
    writer's add_<key> values: bos_token_id=None leaves one out) says otherwise."""
    tokens, scores, kinds = spm_vocabulary(size, *names)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    for key, value in {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, **metadata}.items():
        if value is not None:
            getattr(writer, f"add_{key}")(value)


def write_spm_gguf(path, arch: str, size: int = 400, **vocabulary) -> None:
    """A metadata-only `arch` GGUF with the SentencePiece vocabulary of add_spm_vocabulary."""
    writer = gguf.GGUFWriter(path, arch)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 128), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4)):
        add(value)
    add_spm_vocabulary(writer, size, **vocabulary)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CASES = {
    "llama": ("llama", {}),
    "llama-ends": ("llama", dict(add_bos_token=False, add_eos_token=True, add_space_prefix=False)),
    "llama-no-ids": ("llama", dict(bos_token_id=None, eos_token_id=None, unk_token_id=None)),
    # transformers' defaults "<s>", "</s>", "<unk>" absent: new special ids past the vocabulary
    "llama-other-names": ("llama", dict(names=("<bos>", "<eos>", "<pad>"), pad_token_id=0, unk_token_id=None)),
    "llama-normal-pad": ("llama", dict(pad_token_id=300)),  # a normal piece named pad: special
    "mistral": ("mistral", dict(add_bos_token=True)),
    "phi3": ("phi3", {}),
    "phi3-ends": ("phi3", dict(add_bos_token=False, add_eos_token=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sentencepiece_tokenizer_equals_transformers(tmp_path, case):
    arch, vocabulary = CASES[case]
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, arch, **vocabulary)
    reader = loader._gguf_reader(path)
    assert native_vocabulary(reader)
    ours = GGUFTokenizer(reader)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id, theirs.pad_token_id)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), \
                    (text, special, skip)
    assert len(ours.encode("the quick brown fox", add_special_tokens=False)) < len("the quick brown fox")  # merged
    emoji = ours.convert_ids_to_tokens(ours.encode("😀", add_special_tokens=False))
    assert emoji[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # byte fallback


def test_merges_follow_the_scores_as_transformers():
    """The merges a vocabulary without tokenizer.ggml.merges implies are transformers' generate_merges
    (best score first, longer left then right pieces first, ties in vocabulary order)."""
    from transformers.tokenization_utils_base import generate_merges

    tokens, scores, _ = spm_vocabulary(400)
    tokens += ["▁t", "he", "▁the", "h", "▁th", "e"]  # duplicates: the later id wins, the first position stays
    scores += [-3.0, -3.0, -1.0, 0.0, -3.0, 0.0]
    want = generate_merges({token: index for index, token in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert spm_merges(tokens, scores) == want and len(want) > 50


def test_vocabularies_left_to_transformers(tmp_path):
    """Gemma's SentencePiece vocabulary is not built here (its spaces and merge order differ): the
    loader converts it through transformers; one without scores or merges is refused by name."""
    write_spm_gguf(tmp_path / "gemma.gguf", "gemma2")
    assert not native_vocabulary(loader._gguf_reader(tmp_path / "gemma.gguf"))
    with pytest.raises(ValueError, match="neither byte-level BPE"):
        GGUFTokenizer(loader._gguf_reader(tmp_path / "gemma.gguf"))
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁t"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        GGUFTokenizer(loader._gguf_reader(tmp_path / "bare.gguf"))
