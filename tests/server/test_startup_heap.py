"""`blockserve serve` freezes the heap start-up leaves (app.freeze_startup_heap) before it serves: a full
garbage collection then scans only what serving allocates, not the ~400k objects of torch, transformers
and the model (~185 ms a collection, the engine thread holding the GIL)."""

from __future__ import annotations

import gc
import types
import weakref

from blockserve.server import app as app_module
from blockserve.server.config import ServerConfig


class _Cycle:
    def __init__(self):
        self.me = self


def test_run_server_collects_then_freezes_the_heap_before_serving(monkeypatch):
    leftover = _Cycle()  # start-up garbage in a reference cycle: collected, not frozen
    gone = weakref.ref(leftover)
    del leftover
    seen = {}

    def serve(app, config, drain):
        seen["frozen"] = gc.get_freeze_count()
        seen["leftover_collected"] = gone() is None
        return True

    # The engine and the app stand in: what is under test is what run_server does before it serves.
    engine = types.SimpleNamespace(close=lambda: seen.setdefault("closed", True))
    monkeypatch.setattr(app_module, "LLMEngine", lambda config: engine)
    monkeypatch.setattr(app_module, "create_app", lambda engine, config: types.SimpleNamespace(
        state=types.SimpleNamespace(async_engine=None)))
    monkeypatch.setattr(app_module, "serve_with_drain", serve)
    gc.unfreeze()
    try:
        assert app_module.run_server(None, ServerConfig()) == 0
    finally:
        gc.unfreeze()  # the rest of the test process collects as before
    assert seen["leftover_collected"] and seen["closed"]  # the engine is closed once serving ends
    assert seen["frozen"] > 10_000, seen  # this process's imports: torch, fastapi, blockserve
