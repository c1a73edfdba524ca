"""The server's settings, validated once: the model name it answers to, who may call it, how
tenants share the prefix cache (C6), which reasoning parser splits a thinking model's output,
where `blockserve serve` listens, how much it queues (past either bound a new request gets 503
with Retry-After) and how many connections it holds, how long a request may take (504) and a
client may stall a stream, how long a shutdown drains, and the limits a request must keep to at
the edge (limits.py; past one it gets 400, or 413 for the body).

Each field's metadata is its `blockserve serve` flag (blockserve/config_args.py). Imports
nothing heavy, so the CLI's help stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `model=None` loads
ISOLATION_MODES = ("none", "per-key")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")  # reasoning.py's formats; harmony (harmony.py)
MAX_JSON_DEPTH = 500  # under Python's recursion limit (1000), which json.loads recurses against
LIMITS = ("max_request_body_bytes", "max_json_depth", "max_n", "max_prompts", "max_stop", "max_stop_length",
          "max_connections")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = field(default=DEFAULT_MODEL_NAME, metadata={
        "help": "the model name clients send (default: the --model given, else the bundled model's name)"})
    api_keys: tuple[str, ...] = field(default=(), metadata={  # empty: no authentication
        "help": "accepted bearer token (repeatable; or BLOCKSERVE_API_KEY=k1,k2); default: no auth",
        "flag": "--api-key"})
    prefix_cache_isolation: str = field(default="none", metadata={
        "help": "per-key: derive each request's cache salt from its API key (tenants share no blocks)",
        "choices": ISOLATION_MODES})
    open_health_and_metrics: bool = field(default=True, metadata={
        "help": "with --api-key, require the key on /health and /metrics too (default: they stay open for load "
                "balancers and scrapers, as in vLLM)", "flag": "--protect-health-and-metrics"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "split the model's thinking block from its answer into reasoning_content (chat completions); "
                "only for a model whose template thinks (default: no parsing); a harmony template's channels "
                "(GPT-OSS) are always read, openai_gptoss names that", "choices": REASONING_PARSERS})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    # Far above any burst a normal user sends (the bundled benchmarks send 64 prompts), far below
    # what hurts the host (~100 MB of prompt bookkeeping at the token bound).
    max_waiting_requests: int = field(default=4096, metadata={
        "help": "most requests accepted but still waiting for their first token; past it, new requests get "
                "503 with Retry-After"})
    max_waiting_tokens: int = field(default=2_097_152, metadata={
        "help": "most prompt tokens of requests still waiting for their first token; past it, new requests get "
                "503 with Retry-After (a longer prompt is still taken when nothing waits)"})
    # A deadline that no honest request meets is a leak of its blocks: 30 minutes is far above a
    # full-length CPU generation (8192 tokens at 10 tokens/s is under 14 minutes).
    request_timeout: float = field(default=1800.0, metadata={
        "help": "seconds a request may take from its arrival (queueing included) before it is aborted: 504, or an "
                "error event on a stream; a request's body may ask for less with request_timeout"})
    # No engine step on any device finishes within a millisecond, so a deadline under it is one no
    # request can meet: a 400, where a longer one that expires is a 504. A deployment whose steps
    # take longer may raise it to its slowest step.
    min_request_timeout: float = field(default=0.001, metadata={
        "help": "shortest deadline in seconds a request's body may ask for with request_timeout; a shorter one "
                "gets 400"})
    # Far above a live client's pauses (a reader's GC, a busy proxy), far below a stuck socket.
    stream_stall_timeout: float = field(default=30.0, metadata={
        "help": "seconds a streamed response may wait on a client that reads nothing (its socket buffers "
                "full) before the request is aborted and the connection dropped"})
    data_parallel_size: int = field(default=1, metadata={
        "help": "engine replicas, each its own process with its own scheduler and KV cache, behind one front end "
                "that routes each request by prefix affinity balanced against load (see --dp-routing)"})
    shutdown_timeout: float = field(default=20.0, metadata={
        "help": "seconds SIGTERM / SIGINT lets in-flight requests finish (new ones get 503) before aborting "
                "the rest and exiting"})

    # Limits checked at the edge (limits.py), before any engine work. Each is far above what a
    # normal request needs; see each one's comment for the reason of its default.
    # A prompt of 128k tokens is ~1 MB as token ids and ~0.5 MB as text: 16 MiB is 16 of those.
    max_request_body_bytes: int = field(default=16 * 1024 * 1024, metadata={
        "help": "largest request body in bytes; a larger one gets 413 before it is read"})
    # A client sends its head and body in a few round trips: seconds over the slowest link.
    # Apache's mod_reqtimeout allows 20 s for a head, nginx 60 s between a body's reads.
    header_timeout: float = field(default=20.0, metadata={
        "help": "seconds a client has to send a request's line and headers, from connecting or from the end of "
                "the previous response on the connection; past it 408 and the connection is closed (slow-loris "
                "clients)"})
    # Above what a busy server of the default size holds (256 running requests, their streams, the
    # waiting ones and clients' idle kept-alive connections), below the common 1024 open-file
    # limit, so past it the client gets an answer rather than the listener failing to accept.
    max_connections: int = field(default=1000, metadata={
        "help": "most open connections, idle ones included; a request on a connection past it gets 503 with "
                "Retry-After and the connection is closed"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds the server waits for the next piece of a request body; past it 408 and the connection "
                "is closed"})
    # JSON nesting of a real request is under 6 (chat content parts); Python's json recurses per level.
    max_json_depth: int = field(default=64, metadata={
        "help": f"deepest JSON nesting ([ and {{) a request body may have (at most {MAX_JSON_DEPTH})"})
    max_n: int = field(default=128, metadata={  # OpenAI's own bound
        "help": "most samples (n) one request may ask for"})
    # One engine request each; the waiting queue takes 4096 (--max-waiting-requests).
    max_prompts: int = field(default=1024, metadata={
        "help": "most prompts in one /v1/completions request (a list of strings or of token-id lists)"})
    # OpenAI allows 4; real stop sequences ("\n\nUser:", "</answer>") are a few characters long.
    max_stop: int = field(default=64, metadata={"help": "most stop strings one request may give"})
    max_stop_length: int = field(default=256, metadata={
        "help": "longest stop string, in characters (streamed text is held back by up to this much)"})

    def __post_init__(self) -> None:
        if self.prefix_cache_isolation not in ISOLATION_MODES:
            raise ValueError(f"prefix_cache_isolation must be one of {ISOLATION_MODES}, "
                             f"got {self.prefix_cache_isolation!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, "
                             f"got {self.reasoning_parser!r}")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty strings")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting_requests", "max_waiting_tokens", *LIMITS):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (none is unbounded), got {getattr(self, name)}")
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(f"max_json_depth must be at most {MAX_JSON_DEPTH} (Python's json parser recurses once "
                             f"per level), got {self.max_json_depth}")
        for name in ("request_timeout", "stream_stall_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.min_request_timeout <= self.request_timeout:
            raise ValueError(f"min_request_timeout must be > 0 seconds and at most request_timeout "
                             f"({self.request_timeout:g}), got {self.min_request_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
