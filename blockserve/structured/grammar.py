"""From a StructuredOutputsParams to the grammar text llguidance compiles.

JSON (a schema, or json_object) is generated on one line with `, ` and `: ` between items (no
free whitespace, so a small model cannot loop on newlines); a schema's own `x-guidance`
options override that.
"""

from __future__ import annotations

import json

import llguidance

from blockserve.sampling_params import StructuredOutputsParams

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec`; ValueError (with the reason) when it cannot be read."""
    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    # grammar: Lark, or llama.cpp's GBNF (llguidance tells them apart and translates GBNF)
    return llguidance.grammar_from("grammar", spec.grammar)
