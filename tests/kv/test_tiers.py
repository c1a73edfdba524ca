"""The second tier's parts: the checksummed entry, the disk and host-memory tiers, the store and
its writer thread."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from blockserve.kv.tiers import (CorruptEntry, DiskTier, HostMemoryTier, TieredKVStore, TierUnusable, WriterCounts,
                                 entry_key)
from blockserve.kv.tiers.disk import STALE_WRITE_SECONDS
from blockserve.kv.tiers.entry import HEADER_BYTES, decode, encode

KEYS = [entry_key(b"model", 0, bytes([i]) * 32) for i in range(8)]
PAYLOAD = bytes(range(256)) * 4


def test_entry_round_trip_and_every_damage_is_caught():
    data = encode(KEYS[0], PAYLOAD)
    assert decode(KEYS[0], data) == PAYLOAD
    flipped = bytearray(data)
    flipped[HEADER_BYTES + 10] ^= 1
    for bad, why in ((data[:-1], "payload of"), (data[:20], "without an entry header"), (bytes(flipped), "checksum"),
                     (b"x" + data[1:], "without an entry header")):
        with pytest.raises(CorruptEntry, match=why):
            decode(KEYS[0], bad)
    with pytest.raises(CorruptEntry, match="another key"):
        decode(KEYS[1], data)
    # The key names the model, the group and the salted prefix.
    assert len({entry_key(b"model", 0, b"h"), entry_key(b"other", 0, b"h"), entry_key(b"model", 1, b"h"),
                entry_key(b"model", 0, b"g")}) == 4


def test_disk_tier_reads_back_verifies_and_removes_damaged_files(tmp_path):
    tier = DiskTier(str(tmp_path), 10**6)
    for key in KEYS[:3]:
        assert tier.write(key, PAYLOAD)
    assert tier.read(KEYS[0]) == PAYLOAD and tier.contains(KEYS[1])
    os.truncate(tier.path(KEYS[1]), 100)
    with open(tier.path(KEYS[2]), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\xff")
    for key in KEYS[1:3]:
        with pytest.raises(CorruptEntry):
            tier.read(key)
        assert not os.path.exists(tier.path(key)) and not tier.contains(key)
    assert tier.read(KEYS[3]) is None  # never written
    os.unlink(tier.path(KEYS[0]))
    assert tier.read(KEYS[0]) is None and not tier.contains(KEYS[0])


def test_disk_tier_keeps_under_its_cap_least_recently_used_first(tmp_path):
    size = len(encode(KEYS[0], PAYLOAD))
    tier = DiskTier(str(tmp_path), 3 * size)
    for key in KEYS[:3]:
        tier.write(key, PAYLOAD)
    tier.read(KEYS[0])  # now the most recently used
    tier.write(KEYS[3], PAYLOAD)
    assert [tier.contains(k) for k in KEYS[:4]] == [True, False, True, True]
    assert tier.num_bytes == 3 * size and tier.num_scans == 2  # at start, and for the write past the cap
    big = DiskTier(str(tmp_path / "big"), 64 * size)  # past a large cap, a sixteenth is freed at once
    for key in KEYS:
        big.write(key, PAYLOAD)
    for i in range(60):  # the first past the cap removes 4 entries, the next 3 fit without a scan
        big.write(entry_key(b"more", 0, bytes([i]) * 32), PAYLOAD)
    assert big.num_bytes == 64 * size and big.num_scans == 2
    assert [big.contains(k) for k in KEYS] == [False] * 4 + [True] * 4
    assert not tier.write(KEYS[4], PAYLOAD * 4)  # larger than the cap: refused, nothing evicted
    assert tier.num_entries == 3


def test_disk_tier_restart_finds_entries_in_use_order_and_clears_dead_writes(tmp_path):
    size = len(encode(KEYS[0], PAYLOAD))
    tier = DiskTier(str(tmp_path), 10**6)
    for i, key in enumerate(KEYS[:3]):
        tier.write(key, PAYLOAD)
        os.utime(tier.path(key), (1000 + i, 1000 + i))
    tier.read(KEYS[0])  # refreshed: the newest on disk
    # A crash mid-write leaves a temporary file: invisible to readers, removed once old.
    dead = os.path.join(os.path.dirname(tier.path(KEYS[4])), ".dead.tmp")
    live = os.path.join(os.path.dirname(tier.path(KEYS[4])), ".live.tmp")
    os.makedirs(os.path.dirname(dead), exist_ok=True)
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(encode(KEYS[4], PAYLOAD)[:50])
    old = time.time() - STALE_WRITE_SECONDS - 1
    os.utime(dead, (old, old))
    restarted = DiskTier(str(tmp_path), 2 * size)  # a smaller cap: the least recently used goes
    assert not os.path.exists(dead) and os.path.exists(live)
    assert not restarted.contains(KEYS[4]) and restarted.read(KEYS[4]) is None
    assert [restarted.contains(k) for k in KEYS[:3]] == [True, False, True]


def test_two_disk_tiers_share_a_directory(tmp_path):
    size = len(encode(KEYS[0], PAYLOAD))
    a, b = DiskTier(str(tmp_path), 2 * size), DiskTier(str(tmp_path), 2 * size)
    a.write(KEYS[0], PAYLOAD)
    assert b.contains(KEYS[0]) and b.read(KEYS[0]) == PAYLOAD  # b finds a's entry
    assert not b.write(KEYS[0], PAYLOAD)  # held already: not written twice
    b.write(KEYS[1], PAYLOAD)
    assert a.num_bytes == 2 * size  # the directory's count, every engine's writes
    a.write(KEYS[2], PAYLOAD)  # the directory's cap: a removes KEYS[0], the least recently used, b's read
    assert b.read(KEYS[0]) is None and not b.contains(KEYS[0])
    assert b.read(KEYS[2]) == PAYLOAD and b.read(KEYS[1]) == PAYLOAD
    assert a.num_bytes == 2 * size and a.num_entries == 2


def test_the_directory_s_cap_is_the_smallest_of_the_engines_using_it(tmp_path):
    """An engine with a smaller cap brings the directory down to it, for every engine, until it closes."""
    size = len(encode(KEYS[0], PAYLOAD))
    large = DiskTier(str(tmp_path), 4 * size)
    for key in KEYS[:4]:
        large.write(key, PAYLOAD)
    small = DiskTier(str(tmp_path), 2 * size)  # its start-up scan evicts down to its cap
    assert large.num_bytes == 2 * size and [large.contains(k) for k in KEYS[:4]] == [False, False, True, True]
    large.write(KEYS[4], PAYLOAD)  # the large engine's writes keep to the small cap too
    assert large.num_bytes <= 2 * size and large.contains(KEYS[4]) and large.directory_cap == 2 * size
    assert not large.write(KEYS[5], PAYLOAD * 3)  # fits the large cap, not the directory's
    small.close()
    small.close()  # idempotent
    for key in KEYS[5:8]:
        large.write(key, PAYLOAD)
    assert large.num_bytes == 4 * size and large.directory_cap == 4 * size
    assert os.listdir(tmp_path / ".engines") == [os.path.basename(large._registration_path)]
    large.close()
    assert os.listdir(tmp_path / ".engines") == []


def test_the_cap_of_an_engine_that_died_stops_counting_at_the_next_scan(tmp_path):
    size = len(encode(KEYS[0], PAYLOAD))
    dead = subprocess.run([sys.executable, "-c", "import os, sys\nfrom blockserve.kv.tiers import DiskTier\n"
                           f"DiskTier(sys.argv[1], {size})\nos._exit(0)", str(tmp_path)], check=True)
    assert dead.returncode == 0 and len(os.listdir(tmp_path / ".engines")) == 1  # left behind, unlocked
    tier = DiskTier(str(tmp_path), 3 * size)  # its start-up scan finds the dead engine's file
    assert tier.directory_cap == 3 * size and len(os.listdir(tmp_path / ".engines")) == 1
    for key in KEYS[:3]:
        tier.write(key, PAYLOAD)
    assert tier.num_entries == 3
    tier.close()


def test_an_entry_removed_while_it_is_read_is_read_whole_or_missed(tmp_path, monkeypatch):
    """Another engine's eviction never turns a read into an error: an entry removed after its reader
    opened it is read whole (the open file keeps it), one removed before is a miss."""
    tier, other = DiskTier(str(tmp_path), 10**6), DiskTier(str(tmp_path), 10**6)
    tier.write(KEYS[0], PAYLOAD)
    tier.write(KEYS[1], PAYLOAD)
    opened = open

    def open_then_evicted(path, *args, **kwargs):
        f = opened(path, *args, **kwargs)
        os.unlink(path)  # as another engine's eviction would, between the open and the read
        return f

    monkeypatch.setattr("builtins.open", open_then_evicted)
    assert tier.read(KEYS[0]) == PAYLOAD
    monkeypatch.undo()
    assert not tier.contains(KEYS[0]) and other.read(KEYS[0]) is None  # gone now: a miss
    assert other.contains(KEYS[1])
    os.unlink(tier.path(KEYS[1]))  # between the lookup and the read
    assert other.read(KEYS[1]) is None
    tier.close()
    other.close()


WRITER = """
import sys
from blockserve.kv.tiers import DiskTier, entry_key
directory, who, count, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tier = DiskTier(directory, cap)
for i in range(count):
    tier.write(entry_key(b"model", who, i.to_bytes(4, "little")), bytes([who, i % 256]) * (300 + 37 * (i % 5)))
"""


def test_processes_sharing_a_directory_keep_one_cap_for_all(tmp_path):
    """Three processes write 120 entries each at once under one 40 KiB cap: the directory never
    holds more, every entry left is intact, and the shared count is never below the truth."""
    cap, count = 40 * 1024, 120
    DiskTier(str(tmp_path), cap)  # the usage file exists before they race
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(who), str(count), str(cap)])
               for who in range(3)]
    while any(w.poll() is None for w in writers):  # look under the directory's lock, as a writer would
        with open(tmp_path / ".usage", "rb") as usage:
            fcntl.flock(usage, fcntl.LOCK_EX)
            paths = _entry_paths(tmp_path)
            total = sum(os.path.getsize(p) for p in paths)
            counted = int.from_bytes(usage.read(8), "little")
        assert total <= counted <= cap, (total, counted)
    assert [w.wait() for w in writers] == [0, 0, 0]
    paths = _entry_paths(tmp_path)
    total = sum(os.path.getsize(p) for p in paths)
    assert cap // 2 < total <= cap  # full, not emptied
    tier = DiskTier(str(tmp_path), cap)  # counts from a scan
    assert tier.num_bytes == total and tier.num_entries == len(paths)
    for path in paths:
        key = bytes.fromhex(os.path.basename(path)[:-3])
        assert tier.read(key) is not None  # intact (a damaged entry raises CorruptEntry)
    assert not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]


def _entry_paths(directory) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names if name.endswith(".kv")]


def test_a_crash_between_count_and_file_leaves_the_count_high_and_a_scan_corrects_it(tmp_path, monkeypatch):
    size = len(encode(KEYS[0], PAYLOAD))
    tier = DiskTier(str(tmp_path), 4 * size)
    tier.write(KEYS[0], PAYLOAD)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # not an OSError: nothing restores the count, as when the process dies

    monkeypatch.setattr("blockserve.kv.tiers.disk.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        tier.write(KEYS[1], PAYLOAD)
    monkeypatch.undo()
    assert tier.num_bytes == 2 * size and not tier.contains(KEYS[1])  # counted, never written: high
    for key in KEYS[2:5]:
        tier.write(key, PAYLOAD)  # the third passes the (overstated) cap: a scan finds the truth
    assert tier.num_scans == 2 and tier.num_bytes == 4 * size
    assert [tier.contains(k) for k in KEYS[:5]] == [True, False, True, True, True]


def test_unusable_directories_are_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierUnusable, match="cannot be used.*give a directory"):
        DiskTier(str(blocker / "kv"), 10**6)
    if os.geteuid() != 0:  # root writes anywhere
        readonly = tmp_path / "readonly"
        readonly.mkdir()
        readonly.chmod(0o500)
        with pytest.raises(TierUnusable, match="Permission denied"):
            DiskTier(str(readonly), 10**6)
    with pytest.raises(ValueError, match="positive size cap"):
        DiskTier(str(tmp_path), 0)


def test_memory_tier_is_lru_under_its_size():
    tier = HostMemoryTier(3 * len(PAYLOAD))
    for key in KEYS[:3]:
        tier.write(key, PAYLOAD)
    tier.read(KEYS[0])
    tier.write(KEYS[3], PAYLOAD)
    assert [tier.contains(k) for k in KEYS[:4]] == [True, False, True, True]
    assert tier.num_bytes == 3 * len(PAYLOAD) and not tier.write(KEYS[4], PAYLOAD * 4)


def test_store_writes_through_its_thread_and_loads_a_verified_prefix(tmp_path):
    memory, disk = HostMemoryTier(10**6), DiskTier(str(tmp_path), 10**6)
    store = TieredKVStore([memory, disk], b"model")
    try:
        for key in KEYS[:4]:
            assert store.claim(key)
            assert not store.claim(key)  # on its way already
            store.submit(key, PAYLOAD)
        store.flush()
        assert store.is_idle() and not store.claim(KEYS[0])  # held by every tier
        # The writer runs on CPU time the engine's threads leave.
        assert os.sched_getscheduler(store._writer.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert store.num_held(KEYS[:6]) == 4
        with open(disk.path(KEYS[2]), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x00")
        memory2 = HostMemoryTier(10**6)  # a restart: only the disk holds them
        store2 = TieredKVStore([memory2, DiskTier(str(tmp_path), 10**6)], b"model")
        try:
            assert store2.load(KEYS[:4]) == [PAYLOAD, PAYLOAD]  # stops at the damaged third
            assert memory2.contains(KEYS[0])  # copied forward into host memory
            stats = {t.name: t for t in store2.stats().tiers}
            assert stats["disk"].hits == 2 and stats["disk"].load_failures == 1
            assert stats["disk"].bytes_loaded == 2 * len(PAYLOAD)
        finally:
            store2.close()
    finally:
        store.close()
    assert not store._writer.is_alive()


def test_a_tensor_parallel_block_is_one_entry_per_rank_and_held_only_when_every_rank_s_is_intact(tmp_path):
    """Rank 0's store (the scheduler's) keys a block by both ranks' entries; each rank's store writes its own
    entry of a save; a load returns both payloads or, when either rank's entry is missing or damaged, stops."""
    fingerprints = (b"model rank 0 of 2", b"model rank 1 of 2")
    first = TieredKVStore([DiskTier(str(tmp_path), 10**6)], fingerprints, loader_thread=False)
    second = TieredKVStore([DiskTier(str(tmp_path), 10**6)], fingerprints, loader_thread=False, rank=1)
    try:
        keys = [first.key(0, bytes([i]) * 32) for i in range(4)]
        assert keys[0] == (entry_key(fingerprints[0], 0, b"\0" * 32), entry_key(fingerprints[1], 0, b"\0" * 32))
        payloads = [(bytes([i]) * 64, bytes([100 + i]) * 64) for i in range(4)]
        for key, (own, theirs) in zip(keys, payloads):
            assert first.claim(key)
            first.submit(key, own)
        first.flush()
        assert first.is_idle()
        assert first.num_held(keys) == 0 and first.load(keys) == []  # rank 1's entries are not there yet
        assert first.claim(keys[0])  # rank 0's entry alone: still to be saved
        first.release(keys[0])
        for key, (own, theirs) in zip(keys, payloads):
            second.submit(key, theirs)
        second.flush()
        assert first.num_held(keys) == 4 and not first.claim(keys[0])
        assert first.load(keys) == [tuple(map(bytearray, p)) for p in payloads]
        disk = first.tiers[0]
        with open(disk.path(keys[2][1]), "r+b") as f:  # rank 1's entry of the third block, damaged
            f.seek(-1, os.SEEK_END)
            f.write(b"\xff")
        os.unlink(disk.path(keys[3][0]))  # rank 0's of the fourth, gone
        assert first.num_held(keys) == 3  # the damage shows only when read
        assert first.load(keys) == [tuple(map(bytearray, p)) for p in payloads[:2]]
        assert first.num_held(keys) == 2  # the damaged entry was removed
        assert first.stats().tiers[0].load_failures == 1
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError, match="rank 2 has no fingerprint"):
        TieredKVStore([HostMemoryTier(10)], fingerprints, rank=2)


def test_a_rank_s_writer_reports_its_counts_and_rank_0_s_stats_add_them(tmp_path, monkeypatch):
    """Rank 1's writer hands `report` its counts while they change (at most every REPORT_EVERY_S, and
    once idle); rank 0's stats add what its `peers` return to its own writes and drops."""
    monkeypatch.setattr("blockserve.kv.tiers.store.REPORT_EVERY_S", 0.05)
    fingerprints = (b"model rank 0 of 2", b"model rank 1 of 2")
    reports: list[WriterCounts] = []
    first = TieredKVStore([DiskTier(str(tmp_path), 10**6)], fingerprints, loader_thread=False)
    second = TieredKVStore([DiskTier(str(tmp_path), 10**6)], fingerprints, loader_thread=False, rank=1,
                           report=reports.append)
    try:
        keys = [first.key(0, bytes([i]) * 32) for i in range(3)]
        for key in keys:
            assert first.claim(key)
            second.submit(key, b"b" * 40)
        first.submit(keys[0], b"a" * 64)
        first.release(keys[1], 64)  # dropped (as for want of room in the queue)
        first.release(keys[2], 32)
        first.flush()
        second.flush()
        deadline = time.monotonic() + 10
        while not reports or reports[-1].writes != (3,):  # the writer reports once it is idle
            assert time.monotonic() < deadline, reports
            time.sleep(0.01)
        assert reports[-1] == WriterCounts((3,), (120,), (0,), 0, 0) == second.writer_counts()
        time.sleep(0.2)
        assert len({r.writes for r in reports}) == len(reports)  # only changes are reported
        first.peers = lambda: reports[-1:]
        disk = first.stats().tiers[0]
        assert (disk.writes, disk.bytes_written, disk.write_failures) == (1 + 3, 64 + 120, 0)
        assert first.writer_counts().writes == (1,)
        assert (first.stats().writes_dropped, first.stats().bytes_dropped) == (2, 96)
        first.peers = lambda: [WriterCounts((5,), (200,), (1,), 3, 300)]
        stats = first.stats()
        assert (stats.tiers[0].writes, stats.tiers[0].write_failures, stats.writes_dropped) == (6, 1, 5)
        assert stats.tiers[0].entries == 4  # the directory's: rank 0's one entry and rank 1's three
    finally:
        first.close()
        second.close()


class CountingTier(HostMemoryTier):
    def __init__(self):
        super().__init__(10**6)
        self.reads = []  # (key, thread name)

    def read(self, key):
        self.reads.append((key, threading.current_thread().name))
        return super().read(key)


def test_prefetched_blocks_are_read_on_the_loader_thread_and_loaded_without_a_read():
    tier = CountingTier()
    for key in KEYS[:3]:
        tier.write(key, PAYLOAD)
    store = TieredKVStore([tier], b"model", queue_bytes=2 * len(PAYLOAD))
    try:
        store.prefetch(KEYS[:4])  # the fourth is held by no tier
        deadline = time.monotonic() + 10
        while store.reading(KEYS[:4]) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not store.reading(KEYS[:4])
        assert {name for _, name in tier.reads} == {"blockserve-kv-loader"} and len(tier.reads) == 4
        # Room for two payloads: the first read was dropped, so load reads it again (on this thread).
        assert store.load(KEYS[:4]) == [PAYLOAD] * 3
        assert tier.reads[4:] == [(KEYS[0], threading.current_thread().name)]
        assert store.stats().tiers[0].hits == 4
        store.prefetch(KEYS[:2])  # taken by the load: read again
        store.close()  # joins the loader too
        assert not store._loader.is_alive()
    finally:
        store.close()


def test_without_a_loader_thread_a_prefetch_is_read_at_the_next_call():
    tier = CountingTier()
    tier.write(KEYS[0], PAYLOAD)
    store = TieredKVStore([tier], b"model", loader_thread=False)
    try:
        store.prefetch(KEYS[:1])
        assert store.reading(KEYS[:1]) and not tier.reads
        store.prefetch([])
        assert not store.reading(KEYS[:1]) and len(tier.reads) == 1
        assert store.load(KEYS[:1]) == [PAYLOAD] and len(tier.reads) == 1
    finally:
        store.close()


class SlowTier(HostMemoryTier):
    def __init__(self):
        super().__init__(10**6)
        self.gate = threading.Event()

    def write(self, key, payload):
        self.gate.wait(10)
        return super().write(key, payload)


def test_the_queue_is_bounded_in_bytes_drops_what_does_not_fit_and_never_blocks():
    tier = SlowTier()
    store = TieredKVStore([tier], b"model", queue_bytes=3 * len(PAYLOAD))
    try:
        began = time.perf_counter()
        for key in KEYS[:4]:  # three fit (one the writer holds counts until written), the fourth is dropped
            assert store.claim(key)
            store.submit(key, PAYLOAD)
        assert store.claim(KEYS[4])
        store.submit(KEYS[4], PAYLOAD * 2)  # larger than the room left: dropped on submit
        for key in KEYS[5:7]:  # the runner's way: ask before copying the block out
            assert store.claim(key)
            assert not store.has_room(len(PAYLOAD))
            store.release(key, len(PAYLOAD))
        assert time.perf_counter() - began < 1
        stats = store.stats()
        assert stats.queued_bytes == 3 * len(PAYLOAD) == stats.queue_bytes
        assert stats.writes_dropped == 4 and stats.bytes_dropped == 5 * len(PAYLOAD)
        tier.gate.set()
        store.flush()
        assert store.is_idle() and tier.num_entries == 3 and store.stats().queued_bytes == 0
        assert store.has_room(3 * len(PAYLOAD)) and not store.has_room(3 * len(PAYLOAD) + 1)
    finally:
        tier.gate.set()
        store.close()
    with pytest.raises(ValueError, match="positive size"):
        TieredKVStore([HostMemoryTier(10)], b"model", queue_bytes=0)


def test_writes_turned_off_refuse_claims_and_warn_once(tmp_path, caplog):
    """What rank 0 does when another tensor-parallel rank's writes stop: its own writes go off too."""
    store = TieredKVStore([DiskTier(str(tmp_path), 10**6)], b"model")
    try:
        assert store.claim(KEYS[0])
        store.submit(KEYS[0], PAYLOAD)
        store.flush()
        with caplog.at_level(logging.WARNING, logger="blockserve"):
            store.stop_writing("rank 1 cannot write")
            store.stop_writing("rank 2 cannot write")
        assert caplog.text.count("KV offload:") == 1 and "rank 1 cannot write" in caplog.text
        assert (store.writing, store.stopped_why) == (False, "rank 1 cannot write")
        assert not store.claim(KEYS[1]) and not store.has_room(1) and store.is_idle()
        assert store.load(KEYS[:1]) == [PAYLOAD]
    finally:
        store.close()


def test_a_full_disk_turns_writes_off_with_a_warning(tmp_path, monkeypatch, caplog):
    disk = DiskTier(str(tmp_path), 10**6)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = TieredKVStore([disk], b"model")
    try:
        store.claim(KEYS[0])
        store.submit(KEYS[0], PAYLOAD)
        store.flush()
        monkeypatch.setattr("blockserve.kv.tiers.disk.os.writev", no_space)  # the temporary file exists by then
        with caplog.at_level(logging.WARNING, logger="blockserve"):
            store.claim(KEYS[1])
            store.submit(KEYS[1], PAYLOAD)
            store.flush()
        assert "disk tier is full" in caplog.text
        assert not store.stats().writing and not store.claim(KEYS[2]) and store.is_idle()
        assert not store.writing and store.stopped_why.startswith("the disk tier is full")
        with caplog.at_level(logging.WARNING, logger="blockserve"):
            store.stop_writing("another reason")  # already off: the first reason stays, no second warning
        assert store.stopped_why.startswith("the disk tier is full") and "another reason" not in caplog.text
        monkeypatch.undo()
        assert store.load(KEYS[:1]) == [PAYLOAD]  # what is there is still read
        assert not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]
    finally:
        store.close()


def test_a_write_failing_on_the_file_system_turns_writes_off_and_leaves_the_count_true(tmp_path, caplog):
    """A write the file system refuses (here: a file where the entry's folder goes) turns writes off with one
    warning; the directory's count is put back and no temporary file stays."""
    disk = DiskTier(str(tmp_path), 10**6)
    store = TieredKVStore([disk], b"model")
    try:
        store.claim(KEYS[0])
        store.submit(KEYS[0], PAYLOAD)
        store.flush()
        key = next(k for k in KEYS if k.hex()[:2] != KEYS[0].hex()[:2])
        with open(os.path.dirname(disk.path(key)), "wb"):
            pass
        with caplog.at_level(logging.WARNING, logger="blockserve"):
            assert store.claim(key)
            store.submit(key, PAYLOAD)
            store.flush()
        assert "disk tier failed a write" in caplog.text and "Not a directory" in caplog.text
        assert not store.writing and not store.claim(KEYS[2]) and store.is_idle()
        assert store.stats().tiers[0].write_failures == 1
        assert (disk.num_entries, disk.num_bytes) == (1, HEADER_BYTES + len(PAYLOAD))
        assert store.load(KEYS[:1]) == [PAYLOAD]
        assert not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]
    finally:
        store.close()
