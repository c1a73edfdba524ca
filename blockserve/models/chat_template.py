"""A model's Jinja chat template rendered as transformers' `apply_chat_template` renders it, without
importing transformers (a GGUF file's tokenizer, models/gguf_tokenizer.py, and the Hermes tool probe):

    environment  jinja2's immutable sandbox, trim_blocks and lstrip_blocks, the loopcontrols
                 extension and a `{% generation %}` block that renders its body
    globals      raise_exception(message), strftime_now(format), dict(...), namespace(...) (no
                 underscore-prefixed names); the tojson filter is json.dumps (non-ASCII kept)
    variables    messages (each without its None-valued keys; a message's reasoning under
                 reasoning_content / thinking / reasoning filled into reasoning_content and thinking),
                 tools (JSON schemas), add_generation_prompt, the special tokens and the caller's
                 variables, every value rebuilt from plain JSON types

Continuing a final message, documents and assistant-token masks are not rendered here (blockserve's
callers reserve those names, engine/template_kwargs.py): `render` refuses them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING = ("reasoning_content", "thinking", "reasoning")


def render(template: str, messages: list, tools: list | None = None, add_generation_prompt: bool = False,
           **variables: Any) -> str:
    """`messages` (dicts, dataclasses or pydantic models) through `template`; `tools`: JSON schemas
    (dicts); `variables`: the special tokens and the caller's template variables. TypeError for a
    message or tool that is not one; the template's own errors (raise_exception) propagate."""
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise TypeError("tools must be JSON schemas (dicts); functions are not converted here")
    chat = []
    for message in _as_dicts(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages should be dicts, dataclasses or pydantic models, but got {message!r}")
        message = _plain({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[key] for key in _REASONING if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return _compiled(template).render(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt,
                                      **_plain(variables))


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) as dicts, all the way down."""
    if isinstance(value, Mapping):
        return {key: _as_dicts(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _as_dicts(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (the sandbox sees no object's methods); anything else
    becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: its body, rendered in place."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """The template's `dict`: calls and fromkeys only."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore-prefixed names."""

    def __init__(*args, **kwargs):  # jinja2's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes on a "
                                                  f"namespace ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                               dict=_TemplateDict(), namespace=_Namespace)
    return environment.from_string(template)
