"""deferred_schemas: a pydantic model created inside the block builds its validator on first use and
then validates, serializes, describes itself (JSON schema) and refuses bad input exactly as the same
model built eagerly; pydantic's configuration is as it was after the block, also when it raises."""

from __future__ import annotations

import pydantic
import pytest

from blockserve.server.deferred_schemas import deferred_schemas


def _models() -> tuple[type[pydantic.BaseModel], type[pydantic.BaseModel]]:
    class Item(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", strict=True)
        name: str
        weight: float = pydantic.Field(ge=0)

    class Order(pydantic.BaseModel):
        items: list[Item]
        note: str | None = None

    return Item, Order


def _outcome(order: type[pydantic.BaseModel], body: str):
    try:
        return order.model_validate_json(body).model_dump_json()
    except pydantic.ValidationError as error:
        return error.errors(include_url=False)


@pytest.mark.parametrize("body", ['{"items": [{"name": "a", "weight": 1.5}], "note": "x"}',
                                  '{"items": [{"name": "a", "weight": -1}]}',
                                  '{"items": [{"name": 3, "weight": 1, "extra": 0}]}', '{"note": 1}'])
def test_a_deferred_model_answers_as_an_eager_one(body):
    _, eager = _models()
    with deferred_schemas():
        _, deferred = _models()
    assert eager.__pydantic_complete__ and not deferred.__pydantic_complete__
    assert _outcome(deferred, body) == _outcome(eager, body)
    assert deferred.model_json_schema() == eager.model_json_schema()


def test_the_configuration_is_restored_after_the_block():
    before = dict(pydantic.BaseModel.model_config)
    with pytest.raises(RuntimeError):
        with deferred_schemas():
            raise RuntimeError("an import failed")
    assert pydantic.BaseModel.model_config == before
    _, order = _models()
    assert order.__pydantic_complete__  # created after the block: built as it is created


def test_serve_imports_the_server_with_deferred_schemas(monkeypatch):
    """`blockserve serve` imports the server inside deferred_schemas() (the models a start creates
    defer their builds), then runs it."""
    import contextlib

    import blockserve.cli as cli
    import blockserve.server.app as app

    events = []

    @contextlib.contextmanager
    def recorded():
        events.append("deferred")
        yield
        events.append("restored")

    monkeypatch.setattr(cli, "deferred_schemas", recorded)
    monkeypatch.setattr(cli, "frozen_imports", contextlib.nullcontext)  # no gc.freeze of the test process
    monkeypatch.setattr(app, "run_server", lambda engine_config, config: events.append("run") or 0)
    assert cli.main(["serve", "--port", "1"]) == 0
    assert events == ["deferred", "restored", "run"]
