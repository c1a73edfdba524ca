"""The OpenAI wire format: request bodies (validated here, at the edge) and response bodies.

Ranges follow OpenAI's where it states one; a value out of range is a 400 whose `param` names
the field. Unknown fields are ignored, as vLLM does. vLLM's extra sampling fields (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`) and `cache_salt`
are accepted in the body. Logprobs are built here from the engine's per-token entries
(`{token id: Logprob}`: the top n and the sampled token).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from blockserve.engine.outputs import Logprob


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def token_text(entry: dict[int, Logprob], token_id: int) -> str:
    """The text of `token_id` as its logprob entry decoded it ("" if it did not)."""
    logprob = entry.get(token_id)
    return (logprob.decoded_token if logprob is not None else None) or ""


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; `top_logprobs` maps the top n tokens and the sampled one to logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
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
    logprob: float
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
    refusal: str | None = None


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
