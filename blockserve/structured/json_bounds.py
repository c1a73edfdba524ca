"""Bounds on the numbers and whitespace of the JSON a schema's grammar allows, so a small model
cannot run away inside one value: `1200000000000000…` or `8.1111111…` until max_tokens.

llguidance's JSON compiler has no digit limit of its own (llama.cpp's JSON-schema grammars bound
a number's integral part to 16 digits), so the bounds are written into the schema, as keywords
llguidance compiles to bounded regular expressions, wherever the schema sets none itself:

    integer          minimum / maximum  ±(10^max_integer_digits - 1)
    number           exclusiveMinimum / exclusiveMaximum  ±10^max_integer_digits, and
                     multipleOf 10^-max_fraction_digits (no exponent: 1e5 is written 100000)
    any JSON         ({} or true, json_object's values, an object's unlisted properties, an
                     array's unlisted items): the same, through one recursive definition
    whitespace       none by default (structured/grammar.py); a schema whose `x-guidance` asks
                     for flexible whitespace without its own pattern gets at most
                     max_whitespace characters between two tokens

A schema's own bounds (minimum, maximum, exclusive ones, multipleOf, a whitespace_pattern) are
kept as they are. Bounds change no value a schema accepts within them; strings, arrays and
objects stay as long as the schema lets them be (maxLength, maxItems, or max_tokens bounds them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# llguidance keeps integer bounds in 64 bits (past 9.2e18 they saturate) and reads multipleOf as
# a float, 1e-10 being the finest step it takes exactly.
MAX_INTEGER_DIGITS = 18
MAX_FRACTION_DIGITS = 10
ANY_VALUE = "blockserve_any_json"  # the name of the bounded any-JSON definition added to $defs
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
            "contains", "then", "else")  # not `not` nor `if`: a bound there would invert or move the condition


@dataclass(frozen=True)
class JsonBounds:
    """The bounds (see above). The defaults follow llama.cpp: 16 integral digits, 20 characters of
    whitespace; 10 fractional digits is llguidance's finest multipleOf."""

    max_integer_digits: int = 16
    max_fraction_digits: int = MAX_FRACTION_DIGITS
    max_whitespace: int = 20

    def __post_init__(self) -> None:
        if not 1 <= self.max_integer_digits <= MAX_INTEGER_DIGITS:
            raise ValueError(f"max_integer_digits must be in [1, {MAX_INTEGER_DIGITS}], got {self.max_integer_digits}")
        if not 0 <= self.max_fraction_digits <= MAX_FRACTION_DIGITS:
            raise ValueError(f"max_fraction_digits must be in [0, {MAX_FRACTION_DIGITS}], "
                             f"got {self.max_fraction_digits}")
        if self.max_whitespace < 1:
            raise ValueError(f"max_whitespace must be at least 1, got {self.max_whitespace}")

    @property
    def whitespace_pattern(self) -> str:
        return rf"[\x20\x0A\x0D\x09]{{1,{self.max_whitespace}}}"


def bounded_schema(schema: dict | bool, bounds: JsonBounds) -> dict | bool:
    """A copy of JSON schema `schema` with `bounds` written in wherever it sets none (`false`, which
    nothing matches, is returned as it is). Whatever is malformed is left for llguidance to refuse,
    but `$defs` that is not an object: ValueError."""
    if schema is False:
        return False
    root = {} if schema is True else copy.deepcopy(schema)
    ref = {"$ref": f"#/$defs/{ANY_VALUE}"}
    if _is_any(root):
        root = {**ref}
    else:
        _bound(root, bounds, ref)
    any_value = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "string"}, _number(bounds),
                           {"type": "array", "items": ref}, {"type": "object", "additionalProperties": ref}]}
    definitions = root.setdefault("$defs", {})
    if not isinstance(definitions, dict):
        raise ValueError("$defs must be an object")
    definitions[ANY_VALUE] = any_value
    return root


def whitespace_override(schema: dict | bool, bounds: JsonBounds) -> dict[str, Any] | None:
    """llguidance's `overrides` bounding the whitespace of a schema whose `x-guidance` asks for
    flexible whitespace without a pattern of its own; None when there is nothing to bound."""
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(options, dict) and options.get("whitespace_flexible") and not options.get("whitespace_pattern"):
        return {"whitespace_pattern": bounds.whitespace_pattern}
    return None


def _is_any(schema: Any) -> bool:
    """True for a subschema that allows any JSON value: `true`, or only annotations."""
    return schema is True or (isinstance(schema, dict) and set(schema) <= _ANNOTATIONS)


def _types(declared: Any) -> set[str]:
    """The type names a schema's `type` keyword lists (none when it is absent or malformed)."""
    if isinstance(declared, str):
        return {declared}
    return {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()


def _number(bounds: JsonBounds) -> dict:
    limit = 10 ** bounds.max_integer_digits
    return {"type": "number", "exclusiveMinimum": -limit, "exclusiveMaximum": limit,
            "multipleOf": 10.0 ** -bounds.max_fraction_digits}


def _bound(schema: dict, bounds: JsonBounds, ref: dict) -> None:
    """Write the bounds into `schema` and every subschema in a schema position, in place."""
    pending = [schema]
    while pending:
        node = pending.pop()
        types = _types(node.get("type"))
        if types & {"integer", "number"}:
            limit = 10 ** bounds.max_integer_digits
            exclusive = "number" in types  # llguidance keeps an integer's bounds exact only when inclusive
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["exclusiveMaximum" if exclusive else "maximum"] = limit if exclusive else limit - 1
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["exclusiveMinimum" if exclusive else "minimum"] = -limit if exclusive else -(limit - 1)
            if "number" in types and "multipleOf" not in node:
                node["multipleOf"] = 10.0 ** -bounds.max_fraction_digits
        if "object" in types and _is_any(node.get("additionalProperties", True)):
            node["additionalProperties"] = dict(ref)
        if "array" in types and _is_any(node.get("items", True)):  # after prefixItems: the items past them
            node["items"] = dict(ref)
        children: list = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(node[key], name) for name in node[key]]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(node[key], i) for i in range(len(node[key]))]
        for key in _SCHEMAS:
            if key in node:
                children.append((node, key))
        if isinstance(node.get("items"), list):  # draft 4's tuple items
            children += [(node["items"], i) for i in range(len(node["items"]))]
        for holder, key in children:
            child = holder[key]
            if _is_any(child):
                holder[key] = dict(ref)
            elif isinstance(child, dict):
                pending.append(child)
