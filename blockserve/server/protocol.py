"""The OpenAI wire format: request bodies (validated here, at the edge) and response bodies.

Ranges follow OpenAI's where it states one; a value out of range is a 400 whose `param` names
the field. Every field of OpenAI's published requests is declared: honoured, or refused. A field
the engine does not implement is `Annotated` with `unsupported(...)`: sent with a value that
changes nothing (null, or the neutral value listed there) it is accepted; any other value is a
400 `unsupported_parameter` naming it. A field OpenAI does not publish is refused too
(`extra="forbid"`), except vLLM's extensions the engine honours: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `cache_salt`, `structured_outputs` and chat's
`add_generation_prompt` and `chat_template_kwargs`, and blockserve's `request_timeout` (a deadline in seconds).
`tests/server/test_request_fields.py` walks OpenAI's fields against
this. Logprobs are built here from the engine's per-token entries (`{token id: Logprob}`: the
top n and the sampled token).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, PlainSerializer,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from blockserve.engine.outputs import Logprob


class _Body(BaseModel):
    # strict: JSON types as the schema says (no `true` as the token id 1, no "1" as a number)
    model_config = ConfigDict(extra="forbid", strict=True)


class _Request(_Body):
    """A whole request body. Text that cannot be encoded (a lone UTF-16 surrogate: JSON's
    "\\ud800" parses to one, and the tokenizer, the chat template and llguidance refuse it) is
    refused before any field is read, naming where it is (`unencodable_text`: a 400
    `invalid_encoding`, http/errors.py)."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_encodable(cls, data: Any) -> Any:
        found = first_unencodable(data)
        if found is not None:
            where, character, index = found
            raise PydanticCustomError(
                "unencodable_text", "{where}: the text holds a lone UTF-16 surrogate ({character} at character "
                "{index}), which is not a character and cannot be encoded; send valid Unicode (a high surrogate "
                "escape such as \\ud83d must be followed by its low one, such as \\ude00)",
                {"where": where, "character": character, "index": index})
        return data


def first_unencodable(value: Any) -> tuple[str, str, int] | None:
    """(where, the code point as U+XXXX, its index) of the first string in parsed JSON `value`
    that UTF-8 cannot encode, in document order; `where` is the dotted path of the string (for a
    key, of the object holding it). None when every string can be encoded."""
    pending: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return ".".join(path) or "body", f"U+{ord(item[e.start]):04X}", e.start
        elif isinstance(item, dict):
            for key in item:
                found = first_unencodable(key) if isinstance(key, str) else None
                if found is not None:
                    return (".".join(path) or "body"), found[1], found[2]
            pending.extend(((*path, str(k)), v) for k, v in reversed(item.items()) if isinstance(v, (str, dict, list)))
        elif isinstance(item, list):
            pending.extend(((*path, str(i)), v) for i, v in reversed(list(enumerate(item)))
                           if isinstance(v, (str, dict, list)))
    return None


def _whole_number(value: Any) -> Any:
    """A JSON number with no fractional part as the integer it is: JSON Schema's `integer` takes
    2.0 (a generated client may send it); true and "2" stay refused (strict)."""
    return int(value) if type(value) is float and value.is_integer() else value


def Int(**bounds: int) -> Any:
    """The type of every integer a request body holds, within `bounds` (Field's ge, le, ...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


@dataclass(frozen=True)
class _Unsupported:
    """`unsupported`'s annotation: validates as it says, and publishes the values it accepts."""

    hint: str
    neutral: tuple

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        return {"enum": [None, *self.neutral], "description": f"Not supported: {self.hint}"}

    def _check(self, value: Any) -> Any:
        if value is None or any(type(value) is type(n) and value == n for n in self.neutral):
            return value
        raise PydanticCustomError("unsupported_parameter", "{hint}", {"hint": self.hint})


def unsupported(hint: str, *neutral: Any) -> _Unsupported:
    """A field the engine does not implement: null or one of `neutral` (values that change
    nothing) pass; anything else fails validation as `unsupported_parameter`, with `hint` (what
    is missing and what to do) as the message. The OpenAPI document lists the values it takes."""
    return _Unsupported(hint, neutral)


_NO_FUNCTIONS = "the legacy function-calling fields are not supported; remove it and use tools and tool_calls"
_NO_PROMPT_CACHE_POLICY = "the prefix cache has no per-request policy here (caching is automatic); remove it"


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: Annotated[bool | None, unsupported(
        "stream obfuscation is not implemented; remove it or set it to false", False)] = None


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs` request field: exactly one of the constraints. vLLM's other
    options are refused by name (the engine has no fallback backend, and its JSON layout is fixed)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None
    structural_tag: Annotated[Any, unsupported("structural tags are not supported; use json, regex, choice "
                                               "or grammar")] = None
    disable_fallback: bool | None = None  # one backend (llguidance), never a fallback: either value holds
    disable_any_whitespace: Annotated[bool | None, unsupported(
        "JSON is always generated without free whitespace here; remove it", True)] = None
    disable_additional_properties: Annotated[bool | None, unsupported(
        "set additionalProperties in the schema itself; remove it", False)] = None
    whitespace_pattern: Annotated[str | None, unsupported(
        "the JSON whitespace is fixed (', ' and ': '); remove it")] = None


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Body):
    """Chat's `response_format`: text (unconstrained), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    model: str | None = None
    n: Int(ge=1) = 1  # at most --max-n (limits.py)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int(ge=-2 ** 63, le=2 ** 63 - 1) | None = None  # a 64-bit generator's (seed + i for sample i)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int()] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # bounded so that penalised logits stay finite in float32 (found by the fuzzer: 5e-324 divided them to inf)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    max_tokens: Int(ge=1) | None = None
    min_tokens: Int(ge=0) = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)
    # blockserve's own: this request's deadline in seconds, in [--min-request-timeout, --request-timeout] (limits.py)
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    user: str | None = None  # an end-user id for abuse monitoring: never changes the output
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100] (generation.py)
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extension


class CompletionRequest(_SamplingFields):
    prompt: str | list[Int()] | list[str] | list[list[Int()]]
    max_tokens: Int(ge=0) | None = 16  # OpenAI's default for completions; 0 only with echo (echo.py)
    logprobs: Int(ge=0, le=20) | None = None
    echo: bool | None = None  # the prompt before the completion; with logprobs, the prompt tokens' too (echo.py)
    # Insertion needs a fill-in-the-middle model and its template (the bundled SmolLM2 has none):
    # a suffix would otherwise be silently ignored.
    suffix: Annotated[str | None, unsupported(
        "suffix (insertion) needs a fill-in-the-middle model and template, which this server does not have; "
        "remove it", "")] = None
    best_of: Int(ge=1) | None = None  # the best n of best_of candidates, at most --max-n (best_of.py)


class TextPart(_Body):
    """A content part; only `type: "text"` is read (chat.py refuses the others by their type)."""

    type: str
    text: str | None = None
    prompt_cache_breakpoint: Any = None  # a caching hint: the prefix cache is automatic, output unchanged
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments; None: any object
    strict: bool | None = None  # the arguments always follow `parameters` (a grammar enforces them)


class Tool(_Body):
    type: Literal["function"]  # custom (free-form) tools are refused
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    """An assistant turn's call (in the history, and in a response)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: Annotated[str | None, unsupported(
        "an assistant message's refusal is not passed to the chat template; remove it or put it in content")] = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: Annotated[Any, unsupported(_NO_FUNCTIONS)] = None
    audio: Annotated[Any, unsupported("audio input is not supported; remove it and send text content")] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=20) | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    # metadata that never changes the output (OpenAI's contract for each)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused unless neutral: the engine does not implement them
    tools: list[Tool] | None = None  # tool calling (tools/)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    functions: Annotated[list[Any] | None, unsupported(_NO_FUNCTIONS + " (or send [])", [])] = None
    function_call: Annotated[Any, unsupported(_NO_FUNCTIONS + " (or send \"none\")", "none")] = None
    response_format: ResponseFormat | None = None
    modalities: Annotated[list[str] | None, unsupported("only text output is supported; remove it or send [\"text\"]",
                                                        ["text"])] = None
    audio: Annotated[Any, unsupported("audio output is not supported; remove it")] = None
    prediction: Annotated[Any, unsupported("predicted outputs are not supported; remove it")] = None
    reasoning_effort: Annotated[Any, unsupported("reasoning effort is not controllable here; remove it")] = None
    verbosity: Annotated[Any, unsupported("verbosity is not controllable here; remove it")] = None
    web_search_options: Annotated[Any, unsupported("web search is not supported; remove it")] = None
    moderation: Annotated[Any, unsupported("moderation is not supported; remove it")] = None
    store: Annotated[bool | None, unsupported("completions are not stored; remove it or set it to false",
                                              False)] = None
    service_tier: Annotated[str | None, unsupported(
        "there is one service tier; remove it or send \"auto\" or \"default\"", "auto", "default")] = None
    prompt_cache_retention: Annotated[str | None, unsupported(
        _NO_PROMPT_CACHE_POLICY + " or send \"in_memory\"", "in_memory")] = None
    prompt_cache_options: Annotated[Any, unsupported(_NO_PROMPT_CACHE_POLICY)] = None


class TokenizeRequest(_Request):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    """POST /tokenize with messages, through the chat template (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int()]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def _wire_logprob(value: float) -> float:
    """-inf (a token a grammar or a penalty ruled out) as -9999.0, as vLLM sends it: JSON has no infinity."""
    return -9999.0 if value == -math.inf else value


WireLogprob = Annotated[float, PlainSerializer(_wire_logprob)]


def token_text(entry: dict[int, Logprob], token_id: int) -> str:
    """The text of `token_id` as its logprob entry decoded it ("" if it did not)."""
    logprob = entry.get(token_id)
    return (logprob.decoded_token if logprob is not None else None) or ""


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; `top_logprobs` maps the top n tokens and the sampled one to logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[WireLogprob | None] = Field(default_factory=list)  # None: the echoed first prompt token
    top_logprobs: list[dict[str, WireLogprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @classmethod
    def build(cls, entries: list[dict[int, Logprob]] | None, token_ids: list[int], offset: int) -> CompletionLogprobs:
        """For the sampled `token_ids`; `offset` is the text offset of the first in the choice's text."""
        result = cls()
        for entry, sampled in zip(entries or [], token_ids):
            token = token_text(entry, sampled)
            result.tokens.append(token)
            result.token_logprobs.append(entry[sampled].logprob)
            result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
            result.text_offset.append(offset)
            offset += len(token)
        return result


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: WireLogprob
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None

    @classmethod
    def build(cls, entries: list[dict[int, Logprob]] | None, token_ids: list[int], top: int) -> ChatLogprobs:
        """For the sampled `token_ids`, each with its `top` most likely alternatives by rank."""
        content = []
        for entry, sampled in zip(entries or [], token_ids):
            token = token_text(entry, sampled)
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)[:top]
            content.append(TokenLogprob(
                token=token, logprob=entry[sampled].logprob, bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                         bytes=list((lp.decoded_token or "").encode())) for lp in ranked]))
        return cls(content=content)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking block, with --reasoning-parser (reasoning.py)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has id, type and name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blockserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
