"""From a StructuredOutputsParams to the grammar text llguidance compiles.

JSON (a schema, or json_object) is generated on one line with `, ` and `: ` between items (no
free whitespace, so a small model cannot loop on newlines); a schema's own `x-guidance`
options override that. Its numbers (and any whitespace a schema asks for) are bounded as
json_bounds.py says.
"""

from __future__ import annotations

import json

import llguidance

from blockserve.sampling_params import StructuredOutputsParams
from blockserve.structured.json_bounds import JsonBounds, bounded_schema, whitespace_override

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputsParams, bounds: JsonBounds = JsonBounds()) -> str:
    """The llguidance grammar for `spec`, JSON within `bounds`; ValueError (with the reason) when
    it cannot be read."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object (or true / false)")
        return llguidance.LLMatcher.grammar_from_json_schema(  # as text: integers past 64 bits stay numbers
            json.dumps(bounded_schema(schema, bounds)), defaults=JSON_LAYOUT,
            overrides=whitespace_override(schema, bounds))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    # grammar: Lark, or llama.cpp's GBNF (llguidance tells them apart and translates GBNF)
    return llguidance.grammar_from("grammar", spec.grammar)
