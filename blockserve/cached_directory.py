"""A cache entry that is a directory, made once and shared by every process that wants it."""

from __future__ import annotations

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
