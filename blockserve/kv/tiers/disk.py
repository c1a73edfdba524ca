"""The disk tier: one file per entry under a directory, least recently used evicted past a cap.

    <directory>/<key hex[:2]>/<key hex>.kv       an entry (kv/tiers/entry.py), verified on read
    <directory>/<key hex[:2]>/.<key hex>.*.tmp   a write in progress, renamed into place when whole

Writes are atomic (a temporary file renamed over the entry), so no reader ever sees a torn
entry; a crash leaves only a temporary file, which a later start removes once it is old. Several
engines may share a directory: each keeps its own index of what it saw (the files found at start,
its own writes, hits) for its size cap, and a lookup checks the file system, so one engine finds
another's entries; an entry another engine evicted is a miss. A read refreshes the entry's
modification time, so a restart orders the index as the last run used it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict

from blockserve.kv.tiers.entry import HEADER_BYTES, CorruptEntry, check, encode

logger = logging.getLogger("blockserve")

SUFFIX = ".kv"
STALE_WRITE_SECONDS = 600.0  # a temporary file this old belongs to a write that died


class TierUnusable(ValueError):
    """The tier's directory cannot be created, read or written."""


class TierFull(OSError):
    """The device under the directory ran out of space (or quota)."""


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive size cap, got {capacity_bytes} bytes")
        self.directory = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._probe()
        self._scan()

    # -- start-up ------------------------------------------------------------------------------

    def _probe(self) -> None:
        """TierUnusable, saying what to fix, unless the directory exists (or can be made) and takes a file."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe.{uuid.uuid4().hex}.tmp")
            with open(probe, "wb") as f:
                f.write(b"blockserve")
            os.unlink(probe)
        except OSError as e:
            raise TierUnusable(f"--kv-offload-dir {self.directory!r} cannot be used: {e.strerror or e}; give a "
                               f"directory this process can create and write") from e

    def _scan(self) -> None:
        """Index the entries already there, oldest first; remove temporary files of dead writes."""
        found = []
        now = time.time()
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for item in os.scandir(sub.path):
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # another engine evicted it just now
                if item.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_WRITE_SECONDS:
                        _unlink(item.path)
                elif item.name.endswith(SUFFIX):
                    try:
                        found.append((st.st_mtime, bytes.fromhex(item.name[: -len(SUFFIX)]), st.st_size))
                    except ValueError:
                        continue  # not ours
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._evict(0)

    # -- reads (the scheduler's thread) --------------------------------------------------------

    def path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + SUFFIX)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return os.path.exists(self.path(key))  # written by another engine sharing the directory

    def read(self, key: bytes) -> bytearray | None:
        """The entry's verified payload, None if there is none; CorruptEntry if the file is damaged (it
        is removed, so a later write replaces it)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = f.read(HEADER_BYTES)
                payload = bytearray(max(0, size - len(header)))
                got = f.readinto(payload)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            raise CorruptEntry(f"cannot read {path}: {e}") from e
        try:
            if len(header) + got != size:
                raise CorruptEntry(f"read {len(header) + got} of {size} bytes")
            check(key, header, payload)
        except CorruptEntry:
            _unlink(path)
            self._forget(key)
            raise
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used, for a restart's scan too
        with self._lock:
            if key not in self._index:
                self._bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
        return payload

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    # -- writes (the writer's thread) ----------------------------------------------------------

    def write(self, key: bytes, payload: bytes) -> bool:
        """Store an entry (False if it is larger than the cap); TierFull when the disk is full, and
        OSError for other failures of the file system."""
        data = encode(key, payload)
        if len(data) > self.capacity_bytes:
            return False
        self._evict(len(data))
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
        except OSError as e:
            _unlink(temporary)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(e.errno, f"no space left under {self.directory}") from e
            raise
        with self._lock:
            if key in self._index:
                self._bytes -= self._index[key]
            self._index[key] = len(data)
            self._bytes += len(data)
        return True

    def _evict(self, incoming: int) -> None:
        """Remove least recently used entries until `incoming` more bytes fit under the cap."""
        while True:
            with self._lock:
                if self._bytes + incoming <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            _unlink(self.path(key))

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
