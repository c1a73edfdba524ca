"""n-gram prompt lookup: propose what followed the latest earlier occurrence of the request's last n
tokens, trying n from the longest to the shortest.

    token_ids:  ... a b c d e ... x y a b c  |  ->  proposes d e ...   (n = 3: "a b c" seen before)

Per request an index maps each n-gram to the position after its latest occurrence, extended by the
tokens appended since the last call, so a step costs the new tokens, not the whole history."""

from __future__ import annotations

from collections.abc import Sequence


class _RequestIndex:
    __slots__ = ("by_n", "indexed")

    def __init__(self, sizes: range):
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # positions j < indexed are in by_n (an n-gram ending right before j)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.sizes = range(min_n, max_n + 1)
        self._index: dict[str, _RequestIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens <= 0 or length < 2:
            return []
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _RequestIndex(self.sizes)
        # Index every continuation point j < length: the n-grams ending right before j.
        for j in range(max(index.indexed, 1), length):
            for n, table in index.by_n.items():
                if j >= n:
                    table[tuple(token_ids[j - n:j])] = j
        index.indexed = max(index.indexed, length)
        for n in reversed(self.sizes):
            if n >= length:
                continue
            j = index.by_n[n].get(tuple(token_ids[length - n:]))
            if j is not None:
                return list(token_ids[j:min(j + max_tokens, length)])
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._index)
