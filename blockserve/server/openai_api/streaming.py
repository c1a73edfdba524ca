"""From the engine's cumulative outputs to what a client receives: deltas, SSE events, and the
client going away.

    RequestStream ──► merge() ──► Sent.advance() ──► event()  ──► sse_response()   (stream: true)
    RequestStream ──► collect() (watching for a disconnect)   ──► one JSON body    (stream: false)

A client that disconnects has every stream of its request closed, which aborts the requests
(their blocks return to the pool before the next step). A client that stays connected but reads
nothing fills its socket buffers until sending blocks (uvicorn's flow control); a send blocked
for the streams' `stall_timeout` seconds aborts the requests (finish reason "stalled") and ends
the response unfinished, so uvicorn drops the connection. Meanwhile each stream holds at most
one undelivered output: what a slow reader costs the server is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.server.engine_bridge.async_engine import RequestStream
from blockserve.server.http.errors import error_body, from_exception
from blockserve.server.protocol import token_text

logger = logging.getLogger("blockserve.server")


class Sent:
    """How much of one choice a stream has sent: the next delta from a cumulative output."""

    def __init__(self):
        self.text = 0
        self.tokens = 0
        self.offset = 0  # text offset of the next token's logprob entry
        self.done = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list | None, int] | None:
        """(text delta, new token ids, their logprob entries, text offset of the first), or None
        when nothing changed."""
        if self.done:
            return None
        text = c.text[self.text:]
        new_tokens = len(c.token_ids) - self.tokens
        if not text and not new_tokens and not c.finished:
            return None
        ids = c.token_ids[self.tokens:]
        lps = c.logprobs[self.tokens:] if c.logprobs is not None else None
        offset = self.offset
        if lps:
            self.offset += sum(len(token_text(entry, tid)) for entry, tid in zip(lps, ids))
        self.text, self.tokens, self.done = len(c.text), len(c.token_ids), c.finished
        return text, ids, lps, offset


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


async def collect(streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
    """The final output of each stream, or None if the client disconnected first. Every stream
    is closed on return (aborting what has not finished); an engine error is raised as an APIError."""

    async def run() -> list[RequestOutput]:
        finals = []
        for stream in streams:
            final = None
            async for final in stream:
                pass
            finals.append(final)
        return finals

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            if watcher.exception() is None:
                return None
            logger.warning("cannot watch for a disconnect: %r", watcher.exception())
            await asyncio.wait([task])
        try:
            return task.result()
        except Exception as e:
            raise from_exception(e) from None
    finally:
        task.cancel()
        watcher.cancel()
        for stream in streams:
            stream.close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientStalled(Exception):
    """A send waited longer than the stall timeout: the client reads nothing."""


class _StallGuardedResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within `stall_timeout` seconds; past
    it the streams are closed as stalled and the response ends unfinished (uvicorn closes the
    connection)."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream], stall_timeout: float):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                         background=BackgroundTask(_close_all, streams))
        self.streams, self.stall_timeout = streams, stall_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_within(message) -> None:
            try:  # a timeout, not wait_for: on Python 3.11 that wraps every send in a task
                async with asyncio.timeout(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_within)
        except* _ClientStalled:
            logger.warning("aborting %s: the client read nothing for %g s (--stream-stall-timeout)",
                           ", ".join(s.request_id for s in self.streams), self.stall_timeout)
            _close_all(self.streams, "stalled")


def _close_all(streams: list[RequestStream], reason: str = "abort") -> None:
    for stream in streams:
        stream.close(reason)


def sse_response(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """`events` as server-sent events; the streams are closed once the response ends, also when
    the client disconnected before the body started, or stopped reading (see above)."""
    return _StallGuardedResponse(events, streams, streams[0].stall_timeout)


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def error_event(e: Exception) -> str:
    """An error after the stream started: the status is sent already, so it goes in the body."""
    return f"data: {json.dumps(error_body(from_exception(e)), ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
