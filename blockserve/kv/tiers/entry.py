"""One stored block: its key, its payload and a checksum, verified on every read.

    magic (8) | key (32) | payload length (8, little endian) | sha256(payload) (32) | payload

A key is sha256(model fingerprint | group | salted block hash): it names the model and KV format
the bytes were written by and the whole prefix (cache salt included, C6) they hold, so an entry
another model, format or tenant wrote can never be taken for this one.
"""

from __future__ import annotations

import hashlib

MAGIC = b"BSKVBLK1"
HEADER_BYTES = len(MAGIC) + 32 + 8 + 32


class CorruptEntry(ValueError):
    """Stored bytes that are not a whole, intact entry for the key asked for."""


def entry_key(fingerprint: bytes, group_id: int, block_hash: bytes) -> bytes:
    """The key of group `group_id`'s block of prefix `block_hash` for the model `fingerprint` names."""
    return hashlib.sha256(fingerprint + group_id.to_bytes(4, "little") + block_hash).digest()


def header(key: bytes, payload) -> bytes:
    """The header of the entry of `payload` (any bytes-like object) under `key`."""
    return b"".join((MAGIC, key, len(payload).to_bytes(8, "little"), hashlib.sha256(payload).digest()))


def encode(key: bytes, payload) -> bytes:
    return header(key, payload) + bytes(payload)


def check(key: bytes, header: bytes | bytearray, payload: bytes | bytearray) -> None:
    """CorruptEntry unless `header` + `payload` are a whole, intact entry for `key`."""
    head = memoryview(header)
    if len(head) != HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise CorruptEntry(f"{len(head)} bytes without an entry header")
    at = len(MAGIC)
    if head[at : at + 32] != key:
        raise CorruptEntry("the entry belongs to another key")
    size = int.from_bytes(head[at + 32 : at + 40], "little")
    if len(payload) != size:
        raise CorruptEntry(f"payload of {len(payload)} bytes, header says {size}")
    if hashlib.sha256(payload).digest() != head[at + 40 : HEADER_BYTES]:
        raise CorruptEntry("checksum mismatch")


def decode(key: bytes, data: bytes | bytearray) -> bytearray:
    """The payload of the entry `data`, or CorruptEntry if it is truncated, altered or another key's."""
    view = memoryview(data)
    payload = bytearray(view[HEADER_BYTES:])
    check(key, view[:HEADER_BYTES], payload)
    return payload
