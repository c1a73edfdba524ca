"""What a request body must be beyond its pydantic model's own schema, stated in JSON Schema for
the OpenAPI document (openapi.py), so that what /openapi.json allows is what the routes take: a
generated client's well-formed request is answered, and a fuzzer's broken one refused.

    the server's limits   n, best_of at most --max-n; at most --max-prompts prompts, --max-stop
                          stop strings of 1 to --max-stop-length characters; request_timeout in
                          [--min-request-timeout, --request-timeout] (http/limits.py)
    the engine's          model: the served one; token ids (prompts, stop_token_ids, logit_bias
                          keys, /detokenize) under the vocabulary's size; max_tokens under the
                          model's length; prompts not empty
    one field needs another    stream_options needs stream; top_logprobs needs logprobs; max_tokens
                          0 needs echo; a json_schema response_format needs its json_schema; a
                          tool message needs tool_call_id; tool_choice needs tools
    fields that exclude each other    response_format (not text) and structured_outputs; either and
                          tools; ignore_eos and any grammar (those two, or the tools' own);
                          structured_outputs' kinds (exactly one)
    content parts         text ones, with their text
    chat_template_kwargs  an object without the keys the template rendering reserves (/tokenize's;
                          chat's is said in its description, see below)
    tool call arguments   JSON text

Left out, as JSON Schema cannot say them (a request breaking one is a 400 that names it;
`UNSTATED` lists them): min_tokens at most max_tokens, best_of at least n (and a best_of over n
not streamed), prompt and max_tokens within the model's length together, distinct tool names, a
named tool_choice among the tools, schemas, regular expressions and grammars llguidance can
compile, what a chat template refuses, chat's chat_template_kwargs (an object without reserved
keys, said in its description: the chat request's schema is at the generator's budget), and a prompt of characters the tokenizer drops (it has
no tokens). A tool call's arguments are JSON text, said as `contentMediaType: application/json`,
which validators take as a note and generators do not always follow.

schemathesis' generator (jsonschema_rs' canonical form) gives up past a budget of intersections,
so each cross-field rule is one disjunction of constraints on single fields, and they are few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockserve.engine.template_kwargs import RESERVED_TEMPLATE_KWARGS
from blockserve.sampling_params import LOGIT_BIAS_LIMIT
from blockserve.server.config import ServerConfig

NULL = {"type": "null"}
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")

# The 400s JSON Schema cannot prevent (see above), as (code, param, what the message says).
UNSTATED = (
    ("invalid_value", None, "must not exceed max_tokens"),
    ("invalid_value", "best_of", "must be at least n"),
    ("invalid_value", "best_of", "cannot be streamed"),
    ("context_length_exceeded", None, ""),
    ("invalid_value", "tools", "tool names must be distinct"),
    ("invalid_value", "tool_choice", "which is not among the tools"),
    ("invalid_value", "messages", "arguments that are not JSON"),  # generators may ignore contentMediaType
    ("invalid_value", None, "has an empty prompt"),  # text the tokenizer drops whole (a few control characters)
    ("invalid_value", "structured_outputs", ""),  # what llguidance cannot read or compile
    ("invalid_value", "response_format", ""),
    ("invalid_value", "tools", "cannot be compiled"),
    ("invalid_value", None, "the chat template rejected the messages"),
    ("invalid_value", "chat_template_kwargs", ""),  # chat's: not an object, or a reserved key
)


@dataclass(frozen=True)
class Limits:
    """What the rules depend on: the server's settings and its engine."""

    config: ServerConfig
    vocab_size: int
    max_model_len: int
    native_tools: bool  # the chat template renders tools itself (tools/hermes.py): `auto` has no grammar


def constrain(schemas: dict[str, Any], limits: Limits) -> None:
    """Write the rules into the OpenAPI document's component `schemas`, in place."""
    config = limits.config
    token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    max_tokens = limits.max_model_len - 1  # a prompt holds one token at least
    stop = {"type": "string", "minLength": 1, "maxLength": config.max_stop_length}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = schemas[name]
        props = schema["properties"]
        _set(props, "model", {"type": "string", "const": config.served_model_name})
        props["n"].update(maximum=config.max_n)
        _set(props, "stop", {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": config.max_stop}]})
        _set(props, "stop_token_ids", {"type": "array", "items": token})
        bias = {"type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT}
        _set(props, "logit_bias", {"type": "object", "additionalProperties": bias,
                                   "propertyNames": {"pattern": f"^{decimal_below(limits.vocab_size)}$"}})
        _set(props, "request_timeout", {"type": "number", "minimum": config.min_request_timeout,
                                        "maximum": config.request_timeout})
        schema["allOf"] = [_either(_unset("stream_options"), _is("stream", True))]
    _bound(schemas["CompletionRequest"]["properties"]["max_tokens"], maximum=max_tokens)
    for name in ("max_tokens", "max_completion_tokens"):  # the second wins; the first is checked all the same
        _bound(schemas["ChatCompletionRequest"]["properties"][name], maximum=max_tokens)

    completion = schemas["CompletionRequest"]
    props = completion["properties"]
    prompts = {"minItems": 1, "maxItems": config.max_prompts}
    props["prompt"] = {**_meta(props["prompt"]), "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, **prompts},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1}, **prompts}]}
    _bound(props["best_of"], maximum=config.max_n)
    completion["allOf"] += [
        _either(_values(max_tokens={"not": {"const": 0}}), _is("echo", True)),
        _either(_is("ignore_eos", False), _unset("structured_outputs"))]

    chat = schemas["ChatCompletionRequest"]
    props = chat["properties"]
    props["messages"]["items"] = {"allOf": [props["messages"]["items"], _either(
        _values(role={"not": {"const": "tool"}}),
        {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}})]}
    # Which grammar constrains the output (none; response_format's; structured_outputs'; the tools'),
    # and whether ignore_eos may be set, as one list of the combinations the route takes: every
    # branch a conjunction of constraints on single fields (what schemathesis' generator models).
    no_tools = _values(tools={"anyOf": [NULL, {"maxItems": 0}]}, tool_choice={"anyOf": [NULL, {"const": "none"}]})
    tools = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    tool_states = {  # name -> (constraint, whether the tools add a grammar)
        "none": (no_tools, False),
        "off": ({"allOf": [tools, _is("tool_choice", "none")]}, False),
        "auto": ({"allOf": [tools, _values(tool_choice={"anyOf": [NULL, {"const": "auto"}]})]},
                 not limits.native_tools),
        "forced": ({"allOf": [tools, _given("tool_choice"), _values(tool_choice={"not": {"enum": ["none", "auto"]}})]},
                   True)}
    plain_format = _values(response_format={"anyOf": [NULL, {"properties": {"type": {"const": "text"}}}]})
    constrained_format = {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
    no_grammar = _unset("structured_outputs")
    grammars = {"none": [plain_format, no_grammar], "format": [constrained_format, no_grammar],
                "structured": [plain_format, _given("structured_outputs")]}
    combinations = []
    for state, (tools_constraint, tools_grammar) in tool_states.items():
        for grammar, constraints in grammars.items():
            if state in ("auto", "forced") and grammar != "none":
                continue  # tools in use exclude the other grammars
            free = grammar == "none" and not tools_grammar  # no grammar at all: ignore_eos may be set
            eos = [] if free else [_is("ignore_eos", False)]
            combinations.append({"allOf": [tools_constraint, *constraints, *eos]})
    chat["allOf"] += [
        _either(_unset("top_logprobs"), _is("logprobs", True)),
        {"anyOf": combinations}]

    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token
    for name in ("TokenizeRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        _set(schemas[name]["properties"], "model", {"type": "string", "const": config.served_model_name})
    template_kwargs = {"type": "object", "properties": {key: False for key in RESERVED_TEMPLATE_KWARGS}}
    props = schemas["TokenizeChatRequest"]["properties"]
    _set(props, "chat_template_kwargs", template_kwargs)
    # The chat request's schema is at schemathesis' budget: one more constrained property and its
    # generator gives up, so there the field is described in words (and its 400 is UNSTATED).
    props = schemas["ChatCompletionRequest"]["properties"]
    props["chat_template_kwargs"] = {
        **_meta(props["chat_template_kwargs"]),
        "description": "An object (or null) of variables for the chat template, without the keys "
                       + ", ".join(RESERVED_TEMPLATE_KWARGS)}

    # a call's arguments: JSON text (history_call_arguments); the same in answers
    schemas["ToolCallFunction"]["properties"]["arguments"]["contentMediaType"] = "application/json"

    part = schemas["TextPart"]
    part["properties"]["type"] = {**_meta(part["properties"]["type"]), "type": "string", "const": "text"}
    part["properties"]["text"] = {**_meta(part["properties"]["text"]), "type": "string"}
    part["required"] = ["type", "text"]

    response_format = schemas["ResponseFormat"]
    response_format["allOf"] = [_either(_values(type={"not": {"const": "json_schema"}}), _given("json_schema"))]

    structured = schemas["StructuredOutputsRequest"]
    props = structured["properties"]
    # A schema, or `true` (`false`, which nothing matches, has no grammar). Its JSON text is taken too
    # (vLLM's), but left out here: generators write any string for it, whatever contentMediaType says.
    _set(props, "json", {"anyOf": [{"type": "object"}, {"const": True}]})
    props["json"]["description"] = "A JSON schema (an object, or true); its JSON text is accepted too"
    _set(props, "regex", {"type": "string", "minLength": 1})
    _set(props, "grammar", {"type": "string", "minLength": 1})
    _set(props, "choice", {"type": "array", "items": {"type": "string"}, "minItems": 1})
    unset = {kind: _unset(kind) for kind in GRAMMAR_KINDS}
    unset["json_object"] = _values(json_object={"not": {"const": True}})
    chosen = {kind: _given(kind) for kind in GRAMMAR_KINDS} | {"json_object": _is("json_object", True)}
    structured["anyOf"] = [{"allOf": [chosen[kind], *(unset[other] for other in unset if other != kind)]}
                           for kind in chosen]  # exactly one


def decimal_below(n: int) -> str:
    """A regular expression of the decimal integers in [0, n) as written without sign or leading
    zeros (n >= 1): 0, those shorter than n - 1, then those of its length digit by digit."""
    top = str(n - 1)
    options = ["0"]
    if len(top) > 1:
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    if top != "0":
        for i, digit in enumerate(top):
            low, rest = (1 if i == 0 else 0), len(top) - i - 1
            if int(digit) > low:
                options.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
        options.append(top)
    return "(?:" + "|".join(options) + ")"


# -- JSON Schema pieces: each a constraint on field values, which schemathesis' generator models ----------


def _values(**fields: dict) -> dict:
    """Each of `fields` (present) matches its schema; an absent one passes."""
    return {"properties": fields}


def _unset(field: str) -> dict:
    """`field` is absent or null."""
    return _values(**{field: NULL})


def _given(field: str) -> dict:
    """`field` is present and not null."""
    return {"required": [field], "properties": {field: {"not": NULL}}}


def _is(field: str, value: Any) -> dict:
    """`field` is `value`; with False, absent passes too (the default of every bool field here)."""
    return _values(**{field: {"const": value}}) | ({} if value is False else {"required": [field]})


def _either(*options: dict) -> dict:
    return {"anyOf": list(options)}


def _meta(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k in ("title", "default", "description")}


def _set(props: dict, name: str, schema: dict) -> None:
    """Property `name` becomes `schema` or null (its title and default kept)."""
    props[name] = {**_meta(props[name]), "anyOf": [schema, NULL]}


def _bound(schema: dict, **bounds: int) -> None:
    """Add `bounds` to the integer branch of property `schema` (a nullable one, or plain)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch.update(bounds)
