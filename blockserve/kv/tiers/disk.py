"""The disk tier: one file per entry under a directory, least recently used removed past a size cap
that holds for the directory as a whole, whichever engines and processes share it.

    <directory>/.usage                          bytes and entries the directory holds (its lock)
    <directory>/<key hex[:2]>/<key hex>.kv       an entry (kv/tiers/entry.py), verified on read
    <directory>/<key hex[:2]>/.<key hex>.*.tmp   a write in progress, renamed into place when whole

Writes are atomic (a temporary file renamed over the entry), so no reader ever sees a torn entry;
a crash leaves only a temporary file, which a later start removes once it is old.

Every write and every removal for the cap runs under an exclusive lock on `.usage` (flock: released
by the kernel if its holder dies), which also holds the directory's byte and entry counts. A write
adds its bytes to the count before its file appears, so a crash can leave the count high, never
low; when a write would pass the cap, the writer scans the directory (the true count), removes the
least recently used entries (by modification time: a read refreshes it) down to the cap less one
sixteenth, and stores the count it found. Reads take no lock: an entry another engine removed is a
miss, and a damaged one is removed by its reader (the count stays high until the next scan).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator

from blockserve.kv.tiers.entry import HEADER_BYTES, CorruptEntry, check, header

logger = logging.getLogger("blockserve")

SUFFIX = ".kv"
USAGE_FILE = ".usage"
STALE_WRITE_SECONDS = 600.0  # a temporary file this old belongs to a write that died
SLACK_FRACTION = 16  # a write past the cap makes room for 1/16 of it, so scans are rare


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
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one open file
        self._bytes = self._entries = 0  # the directory's counts, as last seen under the lock
        self.num_scans = 0  # directory scans: at start and when a write passed the cap
        self._probe()
        with self._locked() as fd:
            self._store_usage(fd, *self._evict_to(self.capacity_bytes, clean=True))

    # -- the directory's lock and counts --------------------------------------------------------

    def _probe(self) -> None:
        """TierUnusable, saying what to fix, unless the directory exists (or can be made) and takes a file."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe.{uuid.uuid4().hex}.tmp")
            with open(probe, "wb") as f:
                f.write(b"blockserve")
            os.unlink(probe)
            os.close(os.open(os.path.join(self.directory, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as e:
            raise TierUnusable(f"--kv-offload-dir {self.directory!r} cannot be used: {e.strerror or e}; give a "
                               f"directory this process can create and write") from e

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The usage file's descriptor, held under the directory's exclusive lock."""
        with self._thread_lock:
            fd = os.open(os.path.join(self.directory, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield fd
            finally:
                os.close(fd)  # releases the lock

    def _load_usage(self, fd: int) -> tuple[int, int] | None:
        data = os.pread(fd, 16, 0)
        if len(data) != 16:
            return None  # never written (or by a write that died): unknown
        return int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")

    def _store_usage(self, fd: int, num_bytes: int, entries: int) -> None:
        os.pwrite(fd, num_bytes.to_bytes(8, "little") + entries.to_bytes(8, "little"), 0)
        self._bytes, self._entries = num_bytes, entries

    def _scan(self, clean: bool) -> list[tuple[int, str, int]]:
        """(modification time, path, bytes) of every entry; with `clean`, temporary files of dead
        writes are removed."""
        found = []
        now = time.time()
        self.num_scans += 1
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for item in os.scandir(sub.path):
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed by a reader just now
                if item.name.endswith(SUFFIX):
                    found.append((st.st_mtime_ns, item.path, st.st_size))
                elif clean and item.name.endswith(".tmp") and now - st.st_mtime > STALE_WRITE_SECONDS:
                    _unlink(item.path)
        return found

    def _evict_to(self, target: int, clean: bool = False) -> tuple[int, int]:
        """Under the lock: remove least recently used entries until at most `target` bytes remain;
        the (bytes, entries) left."""
        found = sorted(self._scan(clean))
        total = sum(size for _, _, size in found)
        evicted = 0
        for _, path, size in found:
            if total <= target:
                break
            _unlink(path)
            total -= size
            evicted += 1
        return total, len(found) - evicted

    # -- reads (the scheduler's thread) --------------------------------------------------------

    def path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

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
            return None
        except OSError as e:
            raise CorruptEntry(f"cannot read {path}: {e}") from e
        try:
            if len(header) + got != size:
                raise CorruptEntry(f"read {len(header) + got} of {size} bytes")
            check(key, header, payload)
        except CorruptEntry:
            _unlink(path)
            raise
        _touch(path)  # most recently used
        return payload

    # -- writes (the writer's thread) ----------------------------------------------------------

    def write(self, key: bytes, payload: bytes) -> bool:
        """Store an entry (False if it is larger than the cap or the directory holds it already);
        TierFull when the disk is full, and OSError for other failures of the file system."""
        head = header(key, payload)  # written before the payload: no copy of the payload joins them
        size = len(head) + len(payload)
        if size > self.capacity_bytes:
            return False
        path = self.path(key)
        with self._locked() as fd:
            if os.path.exists(path):
                return False  # another engine wrote it
            usage = self._load_usage(fd)
            if usage is None or usage[0] + size > self.capacity_bytes:
                room = max(size, self.capacity_bytes // SLACK_FRACTION)
                usage = self._evict_to(self.capacity_bytes - room)
            num_bytes, entries = usage
            self._store_usage(fd, num_bytes + size, entries + 1)  # before the file: a crash counts high
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
            try:
                with open(temporary, "wb") as f:
                    f.write(head)
                    f.write(payload)
                os.replace(temporary, path)
                _touch(path)
            except OSError as e:
                _unlink(temporary)
                self._store_usage(fd, num_bytes, entries)
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise TierFull(e.errno, f"no space left under {self.directory}") from e
                raise
        return True

    def _peek(self) -> tuple[int, int]:
        """The directory's (bytes, entries) as the last write by any engine left them (no lock: a gauge)."""
        try:
            fd = os.open(os.path.join(self.directory, USAGE_FILE), os.O_RDONLY)
        except OSError:
            return self._bytes, self._entries
        try:
            return self._load_usage(fd) or (self._bytes, self._entries)
        finally:
            os.close(fd)

    @property
    def num_bytes(self) -> int:
        """The directory's bytes (every engine's entries; a crash or a damaged entry removed by its reader
        leaves it high until the next scan)."""
        return self._peek()[0]

    @property
    def num_entries(self) -> int:
        return self._peek()[1]


def _touch(path: str) -> None:
    """Set the file's modification time to now, to the nanosecond (the kernel's own clock for file
    times is coarser, which would tie entries written within a few milliseconds)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
