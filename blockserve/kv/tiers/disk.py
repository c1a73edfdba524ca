"""The disk tier: one file per entry under a directory, least recently used removed past a size cap
that holds for the directory as a whole, whichever engines and processes share it.

    <directory>/.usage                          bytes, entries and cap of the directory (its lock)
    <directory>/.engines/<id>.cap                an engine using the directory: its cap (shared-locked while it runs)
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
miss (one removed while it is being read is still read whole: its open file keeps it), and a damaged
one is removed by its reader (the count stays high until the next scan).

The directory's cap is the smallest of the caps of the engines using it: each registers its own in
`.engines/` and holds a shared lock on that file while it runs. The cap is worked out again (and
stored in `.usage`, where every write reads it) when an engine starts or closes and at every scan,
which also removes the registrations of engines that died (a file nobody holds a lock on).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator

from blockserve.kv.tiers.entry import HEADER_BYTES, CorruptEntry, check, header

logger = logging.getLogger("blockserve")

SUFFIX = ".kv"
USAGE_FILE = ".usage"
ENGINES_DIR = ".engines"
CAP_SUFFIX = ".cap"
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
        self.directory_cap = capacity_bytes  # the smallest cap of the engines using the directory, as last seen
        self.num_scans = 0  # directory scans: at start and when a write passed the cap
        self._temporary_names = (f"{uuid.uuid4().hex}.{n}.tmp" for n in itertools.count())  # unique to this tier
        self._probe()
        with self._locked() as fd:
            self._registration = self._register()
            self._store_usage(fd, *self._evict_to(self._live_cap(), clean=True))

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

    def _load_usage(self, fd: int) -> tuple[int, int, int] | None:
        """(bytes, entries, cap) of the directory, None while unknown."""
        data = os.pread(fd, 24, 0)
        if len(data) != 24:
            return None  # never written (or by a write that died): unknown
        return tuple(int.from_bytes(data[i : i + 8], "little") for i in (0, 8, 16))

    def _store_usage(self, fd: int, num_bytes: int, entries: int) -> None:
        os.pwrite(fd, b"".join(n.to_bytes(8, "little") for n in (num_bytes, entries, self.directory_cap)), 0)
        self._bytes, self._entries = num_bytes, entries

    # -- the engines using the directory, and its cap ------------------------------------------

    def _register(self) -> weakref.finalize:
        """Under the lock: this tier's registration file, holding its cap, shared-locked until `close`
        (or until the process ends: the kernel releases the lock, and a later scan removes the file)."""
        engines = os.path.join(self.directory, ENGINES_DIR)
        os.makedirs(engines, exist_ok=True)
        path = os.path.join(engines, f"{uuid.uuid4().hex}{CAP_SUFFIX}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.pwrite(fd, self.capacity_bytes.to_bytes(8, "little"), 0)
        self._registration_path = path
        return weakref.finalize(self, os.close, fd)  # a tier dropped without `close` lets its lock go

    def _live_cap(self) -> int:
        """Under the lock: the smallest cap of the engines holding their registration (this one among them,
        until it closes), stored as `directory_cap`; the registrations of engines that died are removed."""
        caps = [self.capacity_bytes] if self._registration.alive else []
        engines = os.path.join(self.directory, ENGINES_DIR)
        with contextlib.suppress(FileNotFoundError):
            for item in os.scandir(engines):
                if item.path == self._registration_path or not item.name.endswith(CAP_SUFFIX):
                    continue
                if (cap := _live_engine_cap(item.path)) is not None:
                    caps.append(cap)
        self.directory_cap = min(caps, default=self.capacity_bytes)
        return self.directory_cap

    def close(self) -> None:
        """Leave the directory: its cap is that of the engines still using it. Idempotent."""
        if not self._registration.alive:
            return
        with self._locked() as fd:
            _unlink(self._registration_path)
            self._registration()
            usage = self._load_usage(fd)
            self._live_cap()
            if usage is not None:
                self._store_usage(fd, usage[0], usage[1])

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
        """Store an entry (False if it is larger than the directory's cap or the directory holds it
        already); TierFull when the disk is full, and OSError for other failures of the file system."""
        head = header(key, payload)  # written before the payload: no copy of the payload joins them
        size = len(head) + len(payload)
        if size > self.capacity_bytes:
            return False
        path = self.path(key)
        with self._locked() as fd:
            if os.path.exists(path):
                return False  # another engine wrote it
            usage = self._load_usage(fd)
            if usage is not None:
                self.directory_cap = usage[2]
            if usage is None or usage[0] + size > self.directory_cap:
                cap = self._live_cap()  # before the scan: it may have grown since an engine died
                if size > cap:
                    return False
                usage = self._evict_to(cap - max(size, cap // SLACK_FRACTION))
            num_bytes, entries = usage[:2]
            self._store_usage(fd, num_bytes + size, entries + 1)  # before the file: a crash counts high
            temporary = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{next(self._temporary_names)}"
            try:
                _write_file(temporary, head, payload)
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
            usage = self._load_usage(fd)
            return (self._bytes, self._entries) if usage is None else usage[:2]
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

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) of the directory, read once (`stats()` asks every step)."""
        num_bytes, entries = self._peek()
        return entries, num_bytes


def _write_file(path: str, head: bytes, payload) -> None:
    """Create `path` (and its folder) holding `head` then `payload`, in few system calls: each one
    takes the GIL back, and a writer thread holding it stalls the step's thread."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:  # the entry's folder is not there yet
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        parts = [memoryview(head), memoryview(payload).cast("B")]
        while parts:
            done = os.writev(fd, parts)
            while parts and done >= len(parts[0]):
                done -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][done:]
    finally:
        os.close(fd)


def _live_engine_cap(path: str) -> int | None:
    """The cap in an engine's registration file, or None (and the file removed) if no engine holds it."""
    try:
        try:
            fd = os.open(path, os.O_RDWR)  # NFS emulates flock with fcntl locks: an exclusive one needs write access
        except PermissionError:  # another user's engine: its lock can still be tested on a local disk
            fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its engine holds its shared lock: running
            data = os.pread(fd, 8, 0)
            return int.from_bytes(data, "little") if len(data) == 8 else None
        _unlink(path)  # nobody holds it: its engine died (or is just being registered, under the lock: never)
        return None
    finally:
        os.close(fd)


def _touch(path: str) -> None:
    """Set the file's modification time to now, to the nanosecond (the kernel's own clock for file
    times is coarser, which would tie entries written within a few milliseconds)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # nothing there
        os.unlink(path)
