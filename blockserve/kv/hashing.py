"""Prefix-cache block hashes: a chain over full blocks of tokens.

    hash(block i) = sha256(hash(block i-1) | extra keys | token ids of block i)

The chain makes a block's hash name its whole prefix; the extra key (the cache salt) keeps
tenants apart (C6). sha256: as fast as blake2b here (`benchmarks/kv_core.py`, measured in
docs/benchmarks.md); faster hashes such as xxh3 are not collision resistant, and a hash an
attacker can collide would make salt isolation meaningless.
Only full blocks are hashed; a partial block is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"blockserve-prefix-v1"


def extra_keys_bytes(cache_salt: str | None = None) -> bytes:
    """Encode the extra keys once per request; different keys give disjoint hash chains.
    A presence byte keeps None apart from "", a length prefix makes the encoding unambiguous."""
    if cache_salt is None:
        return b"\x00"
    data = cache_salt.encode()
    return b"\x01" + len(data).to_bytes(4, "little") + data


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes) -> BlockHash:
    return hashlib.sha256((parent or _ROOT) + extra_keys + _token_bytes(token_ids)).digest()


class BlockHashChain:
    """The block hashes of one request, extended lazily as its tokens grow.

    One list per block size, since groups may use different block sizes.
    """

    __slots__ = ("extra_keys", "_hashes")

    def __init__(self, block_sizes: Sequence[int], cache_salt: str | None = None):
        self.extra_keys = extra_keys_bytes(cache_salt)
        self._hashes: dict[int, list[BlockHash]] = {bs: [] for bs in block_sizes}

    def get(self, block_size: int, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of `token_ids` (which only ever grows for a request)."""
        hashes = self._hashes[block_size]
        start, end = len(hashes), len(token_ids) // block_size
        if end > start:
            # One conversion for all new blocks, then one sha256 per block over a slice of it.
            data = _token_bytes(token_ids[start * block_size : end * block_size])
            parent, extra, width = hashes[-1] if hashes else _ROOT, self.extra_keys, 4 * block_size
            for offset in range(0, len(data), width):
                parent = hashlib.sha256(parent + extra + data[offset : offset + width]).digest()
                hashes.append(parent)
        return hashes
