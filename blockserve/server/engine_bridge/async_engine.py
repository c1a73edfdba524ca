"""AsyncEngine: the LLMEngine step loop on a background thread, feeding one asyncio stream per request.

    event loop (HTTP handlers)                          engine thread (owns the LLMEngine)
    ──────────────────────────                          ──────────────────────────────────
    add_request() ─┐                                    ┌─► apply commands (between steps)
    abort()       ─┼─► commands: queue.Queue ───────────┘        │
    reset_prefix_cache() ─┘  (+ a concurrent Future              ▼
                              for replies)                 LLMEngine.step()
                                                                 │ snapshots of the outputs
    RequestStream (asyncio.Queue) ◄── loop.call_soon_threadsafe ─┘ + stats, latencies

Contracts:
- Only the engine thread touches the LLMEngine (and its tokenizer): adding, aborting and
  resetting the prefix cache are commands applied between two steps, so an abort frees the
  request's blocks before the next step starts.
- A request's error (rejected at add, a bad prompt) goes to that request only: InvalidRequest
  for bad input, anything else (a bug) after taking out whatever of the request got in.
- A failed step (StepFailed: the model runner raised) ends the requests of that step in
  RequestFailed (a 500; the traceback is logged) and the others go on, if the engine's books
  still balance; if they do not, or `step()` raised anything else, it is fatal: every stream
  gets EngineDead and so does every later call (503 until restarted). Never a hang.
- Only LLMEngine's public methods are used, never its core.
- Outputs are cumulative; a slow reader sees only the latest one (deltas are the reader's job).
- Bounded queue: a request waits from its add until its first output (or its end). The engine
  thread, which alone adds, counts the waiting requests and their prompt tokens and decides each
  add against `max_waiting_requests` / `max_waiting_tokens` (a prompt over the token bound is
  taken only when nothing waits), so the bounds are exact; past either the add raises Overloaded.
  Commands themselves wait at most one step: every queued command is applied before the next.
- Deadlines: a request added with a `timeout` (default `request_timeout`) that has not ended
  that many seconds after its add is aborted between two steps (so up to one step late), its
  stream ending in RequestTimeout (504).
- Bounded output: a stream holds at most one undelivered output (outputs are cumulative, so the
  latest replaces the one before), however slowly it is read; `stream_stall_timeout` is how long
  an HTTP response may wait on a client that reads nothing before it is aborted (streaming.py).
- Drain: `drain(timeout)` refuses new adds (Draining), lets the open streams end for up to
  `timeout` seconds, then aborts what is left, each stream ending in ShutdownTimeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from blockserve.engine.llm_engine import LLMEngine, StepFailed
from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.errors import EngineDead, InvalidRequest
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.output import SchedulerStats
from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import Draining, Overloaded, RequestFailed, RequestTimeout, ShutdownTimeout

logger = logging.getLogger("blockserve.server")

Prompt = str | list[int] | Callable[[], str | list[int]]  # a callable runs on the engine thread


class Observer(Protocol):
    """Latencies and token counts, reported from the engine thread (the metrics implement it).
    Engine state is read from `AsyncEngine.stats`, refreshed after every step and command."""

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, inter_token: float | None, num_new_tokens: int) -> None: ...
    def on_finished(self, e2e: float, finish_reasons: list[str]) -> None: ...
    def on_rejected(self, reason: str) -> None: ...  # Unavailable.reason; also from the event loop


@dataclass(frozen=True)
class QueueDepth:
    """Requests added and still waiting for their first output, and their prompt tokens."""

    requests: int = 0
    prompt_tokens: int = 0


@dataclass
class _Live:
    """Engine-thread bookkeeping for one request."""

    stream: RequestStream
    arrival: float
    prompt: str | None  # the text, when the prompt was text
    waiting_tokens: int | None  # prompt tokens while waiting for the first output; None once it came
    timeout: float | None  # seconds from arrival; None: no deadline
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str | None
    stream: RequestStream
    timeout: float | None
    reply: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None  # given: the stream ends in it (it is still being read)
    reason: str = "abort"  # the finish reason the metrics count it under


@dataclass
class _AbortAll:
    error: BaseException


@dataclass
class _Call:
    fn: Callable[[], Any]
    reply: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


_STOP = object()
_READERS_GRACE_S = 5.0  # after a drain's aborts, how long their readers get to send the error


class RequestStream:
    """The outputs of one request, in order; iterate with `async for`, and always `close()`
    (aborting the request if it has not finished: a client that went away)."""

    def __init__(self, engine: AsyncEngine, request_id: str, arrival: float):
        self.request_id = request_id
        self.arrival = arrival
        self.finished = False
        self.stall_timeout = engine.stream_stall_timeout
        self._engine = engine
        self._latest: RequestOutput | BaseException | None = None  # undelivered; an error is the last word
        self._ready = asyncio.Event()
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # event loop only
        if not isinstance(self._latest, BaseException):
            self._latest = item  # cumulative: the newest output says all the older ones did
        self._ready.set()

    @property
    def buffered(self) -> int:
        """Outputs (or an error) delivered and not yet read: 0 or 1, however slow the reader."""
        return int(self._latest is not None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._latest = self._latest, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self.finished = True
        self._engine._stream_ended(self)

    def close(self, reason: str = "abort") -> None:
        """Idempotent; aborts the request (through the engine thread) unless it finished, counted
        under finish reason `reason` (abort: the client went away; stalled: it stopped reading)."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._engine.abort(self.request_id, reason)
            self._engine._stream_ended(self)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: Observer | None = None, *,
                 max_waiting_requests: int = ServerConfig.max_waiting_requests,
                 max_waiting_tokens: int = ServerConfig.max_waiting_tokens,
                 request_timeout: float | None = ServerConfig.request_timeout,
                 stream_stall_timeout: float = ServerConfig.stream_stall_timeout):
        if max_waiting_requests < 1 or max_waiting_tokens < 1:
            raise ValueError(f"the waiting bounds must be at least 1, got {max_waiting_requests} requests, "
                             f"{max_waiting_tokens} tokens")
        if (request_timeout is not None and not request_timeout > 0) or not stream_stall_timeout > 0:
            raise ValueError(f"timeouts must be > 0 seconds, got request_timeout={request_timeout}, "
                             f"stream_stall_timeout={stream_stall_timeout}")
        self.engine = engine
        self.observer = observer
        self.max_model_len: int = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.request_timeout = request_timeout
        self.stream_stall_timeout = stream_stall_timeout
        self._next_deadline = float("inf")  # engine thread only: no live request's deadline is earlier
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._waiting = QueueDepth()  # engine thread only; published as `queue`
        self.queue = QueueDepth()
        self._open: set[RequestStream] = set()  # event loop only: streams not yet ended or closed
        self._idle = asyncio.Event()  # set while `_open` is empty
        self._idle.set()
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._lock = threading.Lock()  # orders "submit a command" against "die and answer them all"
        self.stats: SchedulerStats = engine.stats()

    # -- lifecycle (event loop) --------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="blockserve-engine", daemon=True)
        self._thread.start()

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (Draining) from now on, give the open streams up to `timeout` seconds to
        end, then abort the rest (each stream ends in ShutdownTimeout) and wait a little for their
        readers to see it. Returns how many were aborted."""
        if not self.draining:
            self.draining = True
            logger.info("draining: %d request(s) in flight, up to %g s", len(self._open), timeout)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        left = len(self._open)
        if left:
            logger.warning("aborting %d request(s) still running after %g s (--shutdown-timeout)", left, timeout)
            self._commands.put(_AbortAll(ShutdownTimeout(timeout)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), _READERS_GRACE_S)
        return left

    def _stream_ended(self, stream: RequestStream) -> None:  # event loop only
        self._open.discard(stream)
        if not self._open:
            self._idle.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the current step, fail what is still open, join the thread."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)
        else:
            logger.info("engine stopped")
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    def _submit(self, command: _Add | _Call) -> None:
        """Queue a command that expects a reply; raises EngineDead if none would come."""
        with self._lock:
            if not self.is_alive:
                raise EngineDead(f"the engine is not running: {self._dead or 'not started'}")
            self._commands.put(command)

    # -- requests (event loop) ---------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          cache_salt: str | None = None, timeout: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises the engine's
        reason (InvalidRequest for bad input) if it was not added, leaving nothing behind; Overloaded
        past a waiting bound, Draining once `drain()` began; EngineDead if the engine stopped.
        `timeout`: seconds from now until it is aborted with RequestTimeout (default `request_timeout`)."""
        if self.draining:
            error = Draining()
            if self.observer is not None:
                self.observer.on_rejected(error.reason)
            raise error
        stream = RequestStream(self, request_id, time.monotonic())
        command = _Add(request_id, prompt, params, cache_salt, stream,
                       self.request_timeout if timeout is None else timeout)
        self._submit(command)
        self._open.add(stream)
        self._idle.clear()
        try:
            await asyncio.wrap_future(command.reply)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while the engine was busy: undo the add
            self._stream_ended(stream)
            raise
        except BaseException:
            self._stream_ended(stream)
            raise
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request between two steps; unknown or finished ids are ignored. `reason`: the
        finish reason the metrics count it under."""
        self._commands.put(_Abort(request_id, reason=reason))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between two steps; returns (or raises) what it does."""
        command = _Call(fn)
        self._submit(command)
        return await asyncio.wrap_future(command.reply)

    async def reset_prefix_cache(self) -> tuple[bool, str]:
        """(ok, reason): forget every cached prefix, or say why it cannot now."""
        if not self.engine.config.enable_prefix_caching:
            return False, "prefix caching is disabled on this server (--no-prefix-caching)"
        result = await self.call(self.engine.reset_prefix_cache)
        return result.ok, result.reason

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._apply_commands(block=not engine.has_unfinished_requests()):
                    break
                self._expire(time.monotonic())
                if engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
            reason: BaseException = EngineDead("the server is shutting down")
        except BaseException as e:  # a failed step leaves the engine in an unknown state: stop
            logger.exception("engine step failed; the engine is stopping")
            reason = EngineDead(f"engine step failed: {type(e).__name__}: {e}")
        with self._lock:
            self._dead = reason
        self._fail_all(reason)

    def _step(self) -> None:
        """One engine step; a failed one ends its requests in RequestFailed, and raises (stopping
        the engine) unless the engine is intact."""
        try:
            outputs = self.engine.step()
        except StepFailed as failure:
            logger.error("engine step failed; aborted %d request(s): %s", len(failure.request_ids),
                         failure.request_ids[:8], exc_info=failure.__cause__ or failure)
            now = time.monotonic()
            batch = []
            for request_id in failure.request_ids:
                live = self._live.pop(request_id, None)
                if live is None:
                    continue
                self._started(live)
                if self.observer is not None:
                    self.observer.on_finished(now - live.arrival, ["error"])
                batch.append((live.stream, RequestFailed()))
            if batch:
                self._deliver(batch)
            if not failure.engine_intact:
                raise
            return
        self._publish(outputs)

    def _expire(self, now: float) -> None:
        """Abort every request past its deadline (RequestTimeout)."""
        if now < self._next_deadline:
            return
        next_deadline = float("inf")
        for request_id, live in list(self._live.items()):
            if live.timeout is None:
                continue
            deadline = live.arrival + live.timeout
            if deadline <= now:
                self._abort(request_id, RequestTimeout(live.timeout), "timeout")
            else:
                next_deadline = min(next_deadline, deadline)
        self._next_deadline = next_deadline

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, command.error, command.reason)
            elif isinstance(command, _AbortAll):
                for request_id in list(self._live):
                    self._abort(request_id, command.error)
            elif isinstance(command, _Call) and command.reply.set_running_or_notify_cancel():
                try:
                    command.reply.set_result(command.fn())
                except Exception as e:
                    command.reply.set_exception(e)

    def _add(self, command: _Add) -> None:
        if not command.reply.set_running_or_notify_cancel():
            return  # the caller went away before we got here: nothing to add (nor to abort)
        engine = self.engine
        waiting = self._waiting
        try:
            if waiting.requests >= self.max_waiting_requests:
                raise Overloaded(f"the server is overloaded: {waiting.requests} requests are waiting to start "
                                 f"(--max-waiting-requests {self.max_waiting_requests}); retry later",
                                 "waiting_requests")
            prompt = command.prompt() if callable(command.prompt) else command.prompt
            prompt_ids = engine.tokenize(prompt)  # counted before it is added; add_request checks it again
            if waiting.requests and waiting.prompt_tokens + len(prompt_ids) > self.max_waiting_tokens:
                raise Overloaded(f"the server is overloaded: {waiting.prompt_tokens} prompt tokens are waiting "
                                 f"to start, and this prompt has {len(prompt_ids)} (--max-waiting-tokens "
                                 f"{self.max_waiting_tokens}); retry later", "waiting_tokens")
            engine.add_request(command.request_id, prompt_ids, command.params, cache_salt=command.cache_salt)
        except Exception as e:  # the caller logs what is not an InvalidRequest
            if isinstance(e, Overloaded) and self.observer is not None:
                self.observer.on_rejected(e.reason)
            if not isinstance(e, (InvalidRequest, Overloaded)):
                engine.abort_request([command.request_id])  # whatever got in, take it out
            command.reply.set_exception(e)
            return
        self._live[command.request_id] = _Live(command.stream, command.stream.arrival,
                                               prompt if isinstance(prompt, str) else None, len(prompt_ids),
                                               command.timeout)
        if command.timeout is not None:
            self._next_deadline = min(self._next_deadline, command.stream.arrival + command.timeout)
        self._waiting = QueueDepth(waiting.requests + 1, waiting.prompt_tokens + len(prompt_ids))
        command.reply.set_result(None)

    def _started(self, live: _Live) -> None:
        """`live` got its first output (or ended): it no longer waits."""
        if live.waiting_tokens is not None:
            self._waiting = QueueDepth(self._waiting.requests - 1, self._waiting.prompt_tokens - live.waiting_tokens)
            live.waiting_tokens = None

    def _abort(self, request_id: str, error: BaseException | None = None, reason: str = "abort") -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return  # finished already, or never added
        self._started(live)
        self.engine.abort_request([request_id])
        if self.observer is not None:
            self.observer.on_finished(time.monotonic() - live.arrival, [reason])
        if error is not None:
            self._deliver([(live.stream, error)])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new = num_tokens - live.num_tokens
            if self.observer is not None and new > 0:
                if live.last_token_time is None:
                    self.observer.on_first_token(now - live.arrival, len(output.prompt_token_ids))
                    self.observer.on_tokens(None, new)
                else:
                    self.observer.on_tokens(now - live.last_token_time, new)
            if new > 0:
                live.num_tokens, live.last_token_time = num_tokens, now
            if new > 0 or output.finished:
                self._started(live)
            if output.finished:
                del self._live[output.request_id]
                if self.observer is not None:
                    self.observer.on_finished(now - live.arrival, [c.finish_reason or "abort" for c in output.outputs])
            batch.append((live.stream, _snapshot(output, live.prompt)))
        if batch:
            self._deliver(batch)

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()  # one reference swap: readers on other threads see old or new
        self.queue = self._waiting

    def _deliver(self, batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        def put_all() -> None:
            for stream, item in batch:
                stream._put(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        batch = [(live.stream, error) for live in self._live.values()]
        try:
            self.engine.abort_request(list(self._live))
        except Exception:  # after a failed step the engine may be in any state; the thread ends anyway
            logger.exception("aborting the open requests failed")
        self._live.clear()
        self._waiting = self.queue = QueueDepth()
        while True:  # answer commands nobody will apply
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (_Add, _Call)) and command.reply.set_running_or_notify_cancel():
                command.reply.set_exception(error)
        if batch:
            self._deliver(batch)


def _snapshot(output: RequestOutput, prompt: str | None) -> RequestOutput:
    """A copy the event loop may read while the engine thread keeps appending to the original
    (with the prompt's text, which the engine did not see: it was given the ids)."""
    return RequestOutput(
        output.request_id, prompt, output.prompt_token_ids,
        [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                          list(c.logprobs) if c.logprobs is not None else None) for c in output.outputs],
        output.num_cached_tokens, output.finished,
        prompt_logprobs=output.prompt_logprobs,  # set once, never appended to
    )
