"""The processes a test leaves: `child_pids()` before and after, their difference must be empty."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids() -> set[int]:
    """This process's children, live or awaiting their reaper (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found
