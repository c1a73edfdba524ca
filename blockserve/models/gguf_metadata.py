"""gguf-py's GGUF reader, with its metadata arrays read on demand.

gguf-py's `GGUFReader` makes two numpy views of the mapped file for every string of an array field
and one for every number: a vocabulary of 49k tokens and 49k merges is ~300k views, seconds of a
start and ~150 MiB of RSS, for lists a load mostly never reads (the tokenizer comes from the cache
entry, or from transformers' own reader of the file). `LazyArrayReader` gives the same fields — the
same `parts`, `data` and `types`, so `ReaderField.contents()` returns what gguf-py's would — but an
array's parts are made when indexed: opening the file costs one pass over its strings' lengths.
"""

from __future__ import annotations

import logging
import struct
import sys
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np

logger = logging.getLogger(__name__)

class LazyArrayReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose fields holding arrays of strings or numbers make their parts on
    demand (`ArrayParts`); every other field is gguf-py's own."""

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            orig_offs = offs
            key_length, key = self._get_str(offs)
            offs += int(key_length.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head = [key_length, key, raw_type]
            parts = self._array_parts(head, offs) if raw_type[0] == gguf.GGUFValueType.ARRAY else None
            if parts is not None:
                size, indices, types = parts.nbytes, parts.data, [gguf.GGUFValueType.ARRAY, parts.item_type]
            else:
                size, field_parts, field_indices, types = self._get_field_parts(offs, raw_type[0])
                parts = head + field_parts
                indices = [index + len(head) for index in field_indices]
            self._push_field(gguf.ReaderField(orig_offs, str(bytes(key), encoding="utf-8"), parts, indices, types),
                             skip_sum=True)
            offs += size
        return offs

    def _array_parts(self, head: list[np.ndarray], offs: int) -> ArrayParts | None:
        """The parts of the array at `offs`; None for an array of arrays (left to gguf-py)."""
        item_type = self._get(offs, np.uint32)
        length = self._get(offs + 4, np.uint64)
        start, count = offs + 12, int(length[0])
        kind = gguf.GGUFValueType(item_type[0])
        if kind == gguf.GGUFValueType.STRING:
            host = sys.byteorder == "little"
            string_length = struct.Struct(("<" if (self.byte_order == "I") == host else ">") + "Q")
            buffer, starts, position = memoryview(self.data), [], start
            record = starts.append
            try:  # each string: its 8-byte length, then its bytes
                for _ in range(count):
                    record(position)
                    position += 8 + string_length.unpack_from(buffer, position)[0]
            except struct.error:  # a length that runs past the end of the file
                position = len(self.data) + 1
            if position > len(self.data):
                raise ValueError(f"GGUF field {bytes(head[1]).decode(errors='replace')}: its strings run past "
                                 f"the end of the file ({len(self.data)} bytes): the file is truncated or corrupt")
            record(position)
            starts = np.array(starts, dtype=np.int64)
            return ArrayParts(self, [*head, item_type, length], kind, starts=starts)
        scalar = self.gguf_scalar_to_np.get(kind)
        if scalar is None:
            return None
        return ArrayParts(self, [*head, item_type, length], kind, values=self._get(start, scalar, count))


def array_values(reader: gguf.GGUFReader, key: str) -> list | None:
    """The array field `key`'s items as Python values (what `field.contents()` returns) without
    making a view per item: strings decoded straight from the mapped file, numbers in one
    conversion; None where the file has no such field."""
    field = reader.fields.get(key)
    if field is None:
        return None
    parts = field.parts
    if not isinstance(parts, ArrayParts):
        return field.contents()
    return parts.values()


def special_token_id(reader: gguf.GGUFReader, key: str) -> int | None:
    """The id the file's tokenizer.ggml.`key` (bos_token_id, eos_token_id, unknown_token_id,
    padding_token_id) names; None where it has none, or where the id is outside the vocabulary
    (tokenizer.ggml.tokens): dropped with a warning naming it, as llama.cpp drops a "bad special
    token" and as the loader drops an end-of-generation id outside it."""
    field = reader.fields.get(f"tokenizer.ggml.{key}")
    if field is None:
        return None
    token = int(field.contents())
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = None if tokens is None else len(tokens.data)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        logger.warning("GGUF tokenizer.ggml.%s %d is outside the vocabulary (%s tokens); ignored: the model has "
                       "no such special token (fix the file's metadata)", key, token, vocab_size)
        return None
    return token


class ArrayParts(Sequence):
    """The parts list of an array field, as gguf-py lays it out: key length, key, value type, item
    type, item count, then per item its parts (a string: its length, its bytes; a number: a
    one-element view), each view made when indexed. `data`: the indices of the items' values."""

    def __init__(self, reader: gguf.GGUFReader, head: list[np.ndarray], item_type: gguf.GGUFValueType,
                 starts: np.ndarray | None = None, values: np.ndarray | None = None) -> None:
        self._reader, self._head, self.item_type = reader, head, item_type
        self._starts, self._values = starts, values
        first = len(head)
        if starts is not None:
            self._count = 2 * (len(starts) - 1)
            self.data = range(first + 1, first + self._count, 2)
            self.nbytes = 12 + int(starts[-1] - starts[0])
        else:
            self._count = len(values)
            self.data = range(first, first + self._count)
            self.nbytes = 12 + int(values.nbytes)

    def __len__(self) -> int:
        return len(self._head) + self._count

    def values(self) -> list:
        """The items: strings decoded as UTF-8 from the file's bytes, or numbers as Python scalars."""
        if self._values is not None:
            return self._values.tolist()
        return decoded_strings(np.asarray(self._reader.data), self._starts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < len(self._head):
            return self._head[index]
        if self._values is not None:
            item = index - len(self._head)
            return self._values[item:item + 1]
        item, which = divmod(index - len(self._head), 2)
        length = self._reader._get(int(self._starts[item]), np.uint64)
        return length if which == 0 else self._reader._get(int(self._starts[item]) + 8, np.uint8, length[0])


_SEPARATOR = 0  # a byte joining the strings for one decode (a string holding it is decoded on its own)


def decoded_strings(data: np.ndarray, starts: np.ndarray) -> list[str]:
    """The GGUF strings (8-byte length, then UTF-8 bytes) starting at `starts[:-1]` of the bytes
    `data`, `starts[-1]` their end, decoded in one pass: each length's first byte becomes a separator
    and the other seven are dropped, the whole decoded once and split. UnicodeDecodeError for bytes
    that are not UTF-8, as a decode of each string raises."""
    base, count = int(starts[0]), len(starts) - 1
    if count == 0:
        return []
    region = np.array(data[base:int(starts[-1])])
    lengths = starts[:-1] - base
    keep = np.ones(len(region), dtype=bool)
    keep[(lengths[:, None] + np.arange(1, 8)).ravel()] = False
    keep[0] = False  # the first string's separator
    region[lengths] = _SEPARATOR
    items = region[keep].tobytes().decode("utf-8").split(chr(_SEPARATOR))
    if len(items) == count:
        return items
    text = region.tobytes()  # a string holds the separator byte: each decoded on its own
    return [text[start + 8:end].decode("utf-8") for start, end in zip(lengths.tolist(), (starts[1:] - base).tolist())]
