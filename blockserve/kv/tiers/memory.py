"""The host-memory tier: entries in this process's memory, least recently used evicted past a cap.

In front of the disk tier it answers repeated hits without a read; under a CUDA device pool it is
the second tier by itself. Its payloads never leave the process, so they carry no checksum.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class HostMemoryTier:
    name = "memory"

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the host-memory tier needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def read(self, key: bytes) -> bytearray | None:
        with self._lock:
            payload = self._entries.get(key)
            if payload is None:
                return None
            self._entries.move_to_end(key)
        return bytearray(payload)

    def write(self, key: bytes, payload: bytes) -> bool:
        """Hold `payload` under `key` (False, and nothing changes, if it is larger than the tier or held already)."""
        if len(payload) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._entries:
                return False
            while self._entries and self._bytes + len(payload) > self.capacity_bytes:
                self._bytes -= len(self._entries.popitem(last=False)[1])
            self._entries[key] = bytes(payload)
            self._bytes += len(payload)
        return True

    def close(self) -> None:
        """Let go of the entries."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held."""
        return len(self._entries), self._bytes
