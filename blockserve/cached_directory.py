"""The project's cache: its root, and entries that are directories made once and shared by every
process that wants them (cached_directory) or small files written whole (write_atomically)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cached_directory(entry: Path, fill: Callable[[Path], None]) -> Path:
    """`entry`, made first by `fill(tmp)` in a temporary sibling renamed into place unless it exists.
    Another process never sees it half made; one that loses the race to the rename uses the
    winner's. A failing `fill` leaves nothing behind and raises."""
    if entry.is_dir():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        fill(tmp)
        tmp.rename(entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.is_dir():  # not merely beaten to the rename by another process
            raise
    return entry


def cache_root(cache_dir: str | None = None) -> Path:
    """Where blockserve caches what it derives once per file or per machine: `cache_dir`, else
    $BLOCKSERVE_CACHE_DIR, else ~/.cache/blockserve."""
    return Path(cache_dir or os.environ.get("BLOCKSERVE_CACHE_DIR") or Path.home() / ".cache" / "blockserve")


def write_atomically(path: Path, text: str) -> None:
    """`text` written to `path` through a temporary sibling renamed into place: a reader sees the old
    file or the whole new one, never part of it. OSError where the directory is not writable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
