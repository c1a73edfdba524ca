"""The errors a request can end in, raised by the scheduler and the engine, answered by the server.

    ValueError ── InvalidRequest (code, param)   bad input the caller can fix
                    └── RequestRejected          a request that can never be served (C5)
                          └── PromptTooLong      prompt + max_tokens over the model's length
    RuntimeError ── EngineDead                   the engine stopped: nothing can be served

The server answers InvalidRequest and its subclasses with a 400 carrying `code` (OpenAI's error
code) and `param`, EngineDead with a 503, and anything else with a 500. Bad input stays a
ValueError, so offline callers may catch that. Stdlib only: the scheduler imports this module
and must never import torch.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Input the caller can fix; the message says what is wrong and what to do."""

    code = "invalid_value"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param


class RequestRejected(InvalidRequest):
    """A request that can never be served (empty, malformed token ids, too long for the cache,
    an id in use); rejected at once, leaving nothing behind."""


class PromptTooLong(RequestRejected):
    """The prompt plus the tokens asked for exceed the model's maximum length."""

    code = "context_length_exceeded"


class EngineDead(RuntimeError):
    """The engine stopped (shut down, or a step failed); no request can be served."""
