"""`chat_template_kwargs` (vLLM's name): variables a caller hands the chat template, such as
Qwen3's `enable_thinking`. The names the tokenizer's own rendering takes are refused: passed as
variables they would break it or change what it renders from."""

from __future__ import annotations

from typing import Any

from blockserve.errors import InvalidRequest

# transformers' apply_chat_template parameters, and the conversation under its template name
RESERVED_TEMPLATE_KWARGS = (
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
)


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`kwargs` as template variables ({} for None); InvalidRequest naming the reserved keys it holds."""
    kwargs = dict(kwargs or {})
    reserved = [key for key in kwargs if key in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(reserved)}: reserved by the chat template "
                             "rendering itself (use the request's own fields)", param="chat_template_kwargs")
    return kwargs
