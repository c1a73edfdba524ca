"""LazyArrayReader (models/gguf_metadata.py) reads a GGUF's metadata as gguf-py's reader does: the
same fields, in order, with the same types, parts, byte sizes and contents (whole, one item, a
slice), for arrays of strings (empty ones and multi-byte UTF-8 included), of numbers and of bools,
and an array of arrays (left to gguf-py); and a string array whose lengths run past the file's end
is an error, not a read of whatever lies beyond."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from blockserve.models.gguf_metadata import LazyArrayReader


def write_gguf(path, tokens: list[str]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 64)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1, 6, 2])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0])
    writer.add_array("flags", [True, False, True])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_tensor("output.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_fields_equal_gguf_pys(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, ["<s>", "", "héllo", "世界", "a b"])
    ours, theirs = LazyArrayReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, expected in theirs.fields.items():
        field = ours.fields[name]
        assert (field.offset, field.types, list(field.data)) == (expected.offset, expected.types, list(expected.data)), name
        assert [bytes(part) for part in field.parts] == [bytes(part) for part in expected.parts], name
        assert field.contents() == expected.contents(), name
        if len(expected.data) > 1 and expected.types[-1] != gguf.GGUFValueType.ARRAY:
            assert field.contents(-1) == expected.contents(-1), name
            assert field.contents(slice(1, 3)) == expected.contents(slice(1, 3)), name
    assert ours.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "", "héllo", "世界", "a b"]
    assert [t.name for t in ours.tensors] == ["output.weight"]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


def test_string_lengths_past_the_end_are_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, ["abc", "def"])
    data = bytearray(path.read_bytes())
    at = data.index(b"abc") - 8  # the first token's length
    data[at:at + 8] = (len(data) * 4).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        LazyArrayReader(path)


def test_array_values_equal_the_fields_contents(tmp_path):
    """array_values reads a whole array at once (the tokenizer's vocabulary and merges) and gives what
    gguf-py's contents() gives, for strings (empty and multi-byte ones), numbers, bools and nested arrays."""
    from blockserve.models.gguf_metadata import array_values

    path = tmp_path / "m.gguf"
    write_gguf(path, ["<s>", "", "héllo", "世界", "a b"])
    ours, theirs = LazyArrayReader(path), gguf.GGUFReader(path)
    for name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "flags", "nested"):
        assert array_values(ours, name) == theirs.fields[name].contents(), name
    assert array_values(ours, "tokenizer.ggml.merges") is None


@pytest.mark.parametrize("tokens", [["a\0b", "", "\0", "c"], ["x"]], ids=["separator-byte", "one"])
def test_array_values_of_any_strings(tmp_path, tokens):
    """Strings are decoded in one pass joined by a NUL byte; strings holding that byte, or a single
    string, read back the same."""
    from blockserve.models.gguf_metadata import array_values

    path = tmp_path / "m.gguf"
    write_gguf(path, tokens)
    assert array_values(LazyArrayReader(path), "tokenizer.ggml.tokens") == tokens


def test_array_values_of_bytes_that_are_not_utf8_raise(tmp_path):
    from blockserve.models.gguf_metadata import array_values

    path = tmp_path / "m.gguf"
    write_gguf(path, ["abc", "dÿf"])
    data = bytearray(path.read_bytes())
    data[data.index("dÿf".encode()) + 1] = 0xFF  # a lone byte that starts no UTF-8 sequence
    path.write_bytes(bytes(data))
    with pytest.raises(UnicodeDecodeError):
        array_values(LazyArrayReader(path), "tokenizer.ggml.tokens")
