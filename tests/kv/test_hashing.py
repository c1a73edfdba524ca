"""Prefix-cache hashing: a chain over full blocks, keyed by cache salt (C6)."""

import pytest

from blockserve.kv import BlockHashChain
from blockserve.kv.hashing import extra_keys_bytes, hash_block
from tests.kv.conftest import full, make_manager, new_req, prefill

TOKENS = list(range(100, 140))  # 10 blocks of 4


def hashes(tokens, block_size=4, **extra):
    return BlockHashChain([block_size], **extra).get(block_size, tokens)


def test_only_full_blocks_are_hashed():
    assert len(hashes(TOKENS[:11])) == 2
    assert len(hashes(TOKENS[:3])) == 0


def test_hashes_are_deterministic_and_distinct():
    h = hashes(TOKENS)
    assert h == hashes(TOKENS)
    assert len(set(h)) == len(h)
    assert all(isinstance(x, bytes) and len(x) == 32 for x in h)


def test_a_change_in_an_early_block_changes_every_later_hash():
    base = hashes(TOKENS)
    for changed_block in (0, 3, 9):
        tokens = list(TOKENS)
        tokens[changed_block * 4 + 2] += 1
        changed = hashes(tokens)
        assert changed[:changed_block] == base[:changed_block]
        assert all(a != b for a, b in zip(changed[changed_block:], base[changed_block:]))


def test_equal_blocks_at_different_depths_hash_differently():
    assert len(set(hashes([7] * 40))) == 10


def test_the_chain_extends_lazily_as_tokens_grow():
    chain = BlockHashChain([4, 8])
    tokens = []
    for t in TOKENS:
        tokens.append(t)
        chain.get(4, tokens)
    assert chain.get(4, tokens) == hashes(TOKENS)
    assert chain.get(8, tokens) == hashes(TOKENS, block_size=8)
    assert chain.get(4, tokens) is chain.get(4, tokens)  # computed once, then reused


def test_salts_give_disjoint_chains():
    chains = [
        hashes(TOKENS),
        hashes(TOKENS, cache_salt=""),
        hashes(TOKENS, cache_salt="tenant-a"),
        hashes(TOKENS, cache_salt="tenant-b"),
    ]
    all_hashes = [h for chain in chains for h in chain]
    assert len(set(all_hashes)) == len(all_hashes)


def test_extra_keys_are_length_prefixed():
    """No salt's encoding is a prefix of another's, so salt bytes cannot pose as token bytes."""
    encodings = [extra_keys_bytes(s) for s in (None, "", "a", "ab", "abcd")]
    assert not any(a != b and b.startswith(a) for a in encodings for b in encodings)


@pytest.mark.parametrize("bad", [-1, 2**32, 10**20])
def test_tokens_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        hash_block(None, [1, bad, 2, 3], b"")
    with pytest.raises(ValueError):
        hashes([0, 1, 2, bad])


def test_the_largest_token_id_is_accepted():
    assert hash_block(None, [0, 2**32 - 1], b"") != hash_block(None, [0, 2**32 - 2], b"")


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        ({"salt": "a"}, {"salt": "a"}, True),
        ({"salt": "a"}, {"salt": "b"}, False),
        ({}, {"salt": "a"}, False),
        ({"salt": ""}, {}, False),
    ],
)
def test_the_manager_shares_blocks_only_within_one_salt(first, second, shared):
    manager = make_manager((full(), 32))
    prefill(manager, new_req(manager, "first", TOKENS, **first))
    hit, _ = prefill(manager, new_req(manager, "second", TOKENS, **second))
    assert hit.num_tokens == (36 if shared else 0)
    manager.check_integrity()
