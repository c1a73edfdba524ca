"""The garbage collector during a start. Importing torch and the server and loading a model allocate
~300k objects that live as long as the process; Python's automatic collections rescan every tracked
object each time the old generation grows by a quarter, so an unguarded start runs several full
collections over them (docs/cpu.md, cold start: over a second of a start on the loaded 2-CPU machine).

    paused_collection()   no automatic collection inside the block (the model load); the collector
                          as it was after it, also when the block raises
    frozen_imports()      the same for a block that imports the server's modules in the server's
                          process, then every object alive moved into the permanent generation
                          (gc.freeze), which no collection scans (the server freezes its heap after
                          start-up anyway: server/app.py). What those imports left unreachable (a
                          few thousand objects, no measurable memory) is kept with them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_collection() -> Iterator[None]:
    """No automatic garbage collection inside the block; afterwards the collector is enabled again
    if it was before (an explicit gc.collect() inside still runs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """paused_collection() for a block of imports, then gc.freeze(): the modules' objects stay for the
    process's life, so later collections (the server's after start-up, serving's own) skip them.
    For a process's own start only: whatever garbage is pending when it ends is never freed."""
    with paused_collection():
        yield
    gc.freeze()
