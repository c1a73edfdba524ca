"""Suffix decoding (Oliaro et al., arXiv 2411.04975): propose the continuation that most often
followed the longest match of the request's last tokens, in its own tokens so far and in the
outputs of requests that finished before it.

Each source is a suffix trie: a node per distinct token string of at most `max_depth` tokens, with
how often it occurred. The node of the context's longest matching suffix has the continuations
seen after it, with their counts; drafting walks down the most frequent child while its share of
its siblings is at least `min_token_prob`, taking at most `max_spec_factor` x the match length
tokens. Of the two sources' drafts the one with more expected accepted tokens (the sum of its
prefixes' probabilities) is proposed.

    own:   one trie per running request, extended by the tokens appended since its last proposal
           (O(max_depth) per token)
    cross: one trie over the outputs of the last `max_cached_requests` finished requests; adding one
           evicts the oldest, its counts taken back out (bounded memory)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Counts of every token string of at most `max_depth` tokens in the sequences added."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (sign 1) or uncount (sign -1) the strings of `tokens` as one sequence."""
        active: list[_Node] = []  # nodes of the suffixes (lengths 1..max_depth - 1) ending at the last token
        for token in tokens:
            active = self.extend(active, token, sign)

    def extend(self, active: list[_Node], token: int, sign: int = 1) -> list[_Node]:
        """Count `token` after each suffix in `active` (and after the empty one): the new suffixes
        that can still grow, to pass to the next call."""
        return self._extend([self.root, *active], token, sign)

    def _extend(self, nodes: list[_Node], token: int, sign: int) -> list[_Node]:
        """Each node's child `token` counted by `sign`; those that can still grow (shallower than
        max_depth), deepest last. Uncounted children at zero are removed."""
        grown = []
        for depth, node in enumerate(nodes):  # node at depth `depth` (the root at 0)
            child = node.children.get(token)
            if child is None:
                if sign < 0:
                    raise ValueError("uncounting a string that was never counted")
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += sign
            if child.count == 0:  # so are its descendants' (none outnumbers its prefix): all go
                del node.children[token]
                self.num_nodes -= _size(child)
                continue
            if depth + 1 < self.max_depth:
                grown.append(child)
        return grown

    def match(self, tokens: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `tokens` (at most max_depth - 1 long) that has a
        continuation, and its length; (None, 0) when none has."""
        for length in range(min(self.max_depth - 1, len(tokens)), 0, -1):
            node = self.root
            for token in tokens[len(tokens) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0


def _size(node: _Node) -> int:
    """Nodes in the subtree of `node`, itself included."""
    return 1 + sum(_size(child) for child in node.children.values())


def draft(trie: SuffixTrie, context: Sequence[int], max_tokens: int, max_spec_factor: float,
          min_token_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation of `context`'s longest match in `trie`, and its expected
    accepted tokens (each token's probability times its prefix's)."""
    node, length = trie.match(context)
    limit = min(max_tokens, int(max_spec_factor * length))
    tokens: list[int] = []
    score, prefix = 0.0, 1.0
    while node is not None and len(tokens) < limit:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        probability = child.count / total
        if probability < min_token_prob:
            break
        prefix *= probability
        score += prefix
        tokens.append(token)
        node = child if child.children else trie.match([*context, *tokens])[0]
    return tokens, score


class _Request:
    __slots__ = ("trie", "active", "indexed", "first")

    def __init__(self, max_depth: int, length: int):
        self.trie = SuffixTrie(max_depth)
        self.active: list[_Node] = []
        self.indexed = 0  # tokens counted in the trie
        self.first = length  # its length at its first proposal: its output from there is shared on finish


class SuffixProposer:
    """Suffix decoding over a request's own tokens and the outputs of the last `max_cached_requests`
    finished ones (0: its own only)."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        if max_depth < 2 or max_cached_requests < 0 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("suffix decoding needs max_depth >= 2, max_cached_requests >= 0, "
                             "max_spec_factor > 0 and min_token_prob in [0, 1]")
        self.max_depth, self.max_cached_requests = max_depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.cross = SuffixTrie(max_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # outputs in the cross trie, oldest first
        self._requests: dict[str, _Request] = {}
        # Each running request's tokens as last passed: the scheduler's own list, which grows with the
        # request, so at `forget` it holds the whole output.
        self._tokens: dict[str, Sequence[int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        request = self._requests.get(request_id)
        if request is None:
            request = self._requests[request_id] = _Request(self.max_depth, len(token_ids))
        self._tokens[request_id] = token_ids
        trie = request.trie
        for token in token_ids[request.indexed:]:
            request.active = trie.extend(request.active, token)
        request.indexed = len(token_ids)
        if max_tokens <= 0:
            return []
        # A match is at most max_depth - 1 tokens; the latest tokens' own occurrence has no
        # continuation yet, so it is an earlier one.
        tail = list(token_ids[-self.max_depth:])
        own = draft(trie, tail, max_tokens, self.max_spec_factor, self.min_token_prob)
        cross = draft(self.cross, tail, max_tokens, self.max_spec_factor, self.min_token_prob)
        return max(own, cross, key=lambda proposal: proposal[1])[0]

    def forget(self, request_id: str) -> None:
        """The request ended: its own trie goes, its output joins the cross-request trie."""
        request = self._requests.pop(request_id, None)
        tokens = self._tokens.pop(request_id, None)
        if request is None or tokens is None or not self.max_cached_requests:
            return
        output = list(tokens[max(request.first - 1, 0):])
        self.cross.add(output)
        self._cached[request_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self.cross.add(evicted, sign=-1)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose outputs the cross-request trie holds."""
        return len(self._cached)
