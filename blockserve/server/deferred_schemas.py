"""pydantic models that build their validators on first use. Importing the server defines ~100
pydantic models (FastAPI's OpenAPI document, the wire format in protocol.py), and pydantic builds
each one's core schema, validator and serializer as the class is created: ~0.1 s of CPU in a
`serve` start, for models most of which a start never uses (the OpenAPI document's are used when
/openapi.json is first asked for). pydantic's `defer_build` builds them when the class first
validates or serializes instead, with the same results.

    deferred_schemas()   every pydantic model whose class is created inside the block defers its
                         build (pydantic's defer_build); models created after the block do not
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_schemas() -> Iterator[None]:
    """Inside the block, pydantic's base model's configuration defers building (a class created
    there keeps it: pydantic copies its bases' configuration into each class it creates); after
    it, the configuration as it was, also when the block raises. For a process's start-up imports,
    run on one thread."""
    from pydantic import BaseModel, ConfigDict

    config = BaseModel.model_config
    BaseModel.model_config = ConfigDict(**config, defer_build=True)
    try:
        yield
    finally:
        BaseModel.model_config = config
