"""Compiles StructuredOutputsParams into grammars, once per distinct spec, within a time cap.

    GrammarCompiler(tokenizer, vocab_size, eos_token_id)
        .compile(spec) ─► CompiledGrammar (cached; start_matcher() copies its start state)
                       ─► InvalidRequest with llguidance's reason: unreadable, unsupported, too big,
                          or slower than `limits.compile_timeout_s`

Thread-safe: the server compiles on a worker thread before the request reaches the engine
thread, so a slow compile never stalls the step loop. The llguidance tokenizer (about 0.4 s to
build for a 49k vocabulary) is built on first use. llguidance bounds the work itself (lexer fuel,
Earley items, grammar size: `GrammarLimits`); the timeout is the wall-clock cap on top, after
which the request is refused (the compile, bounded by that fuel, finishes on its own thread).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from copy import copy

import llguidance

from blockserve.errors import InvalidRequest
from blockserve.sampling_params import StructuredOutputsParams
from blockserve.structured.grammar import grammar_text
from blockserve.structured.json_bounds import JsonBounds


@dataclass(frozen=True)
class GrammarLimits:
    """Caps on one grammar (llguidance's ParserLimits, plus a wall-clock cap on its compile), and
    the bounds written into JSON schemas' numbers and whitespace."""

    compile_timeout_s: float = 10.0
    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000  # regex work while building the lexer (~50k per ms)
    step_lexer_fuel: int = 200_000  # lexer work per token mask (~14k per ms)
    step_max_items: int = 50_000  # Earley items per token mask (~20k per ms)
    max_lexer_states: int = 250_000
    cache_size: int = 64  # distinct compiled grammars kept
    json_bounds: JsonBounds = JsonBounds()  # digits and whitespace of JSON values (json_bounds.py)

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, verbose_errors=False)


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar's start state; `start_matcher()` gives each request its own copy."""

    kind: str
    template: llguidance.LLMatcher
    vocab_size: int
    eos_token_id: int

    def start_matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class GrammarCompiler:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_id: int, limits: GrammarLimits = GrammarLimits()):
        """`hf_tokenizer`: a fast Hugging Face tokenizer (None: no grammar can be compiled);
        `vocab_size`: the width of the model's logits; `eos_token_id`: the token the grammar's end forces."""
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.limits = limits
        self._parser_limits = limits.parser_limits()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar for `spec` (from the cache when compiled before)."""
        key = (spec.kind, _source(spec))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            text = grammar_text(spec, self.limits.json_bounds)
        except ValueError as e:
            raise InvalidRequest(f"structured_outputs.{spec.kind} cannot be read: {e}", param=spec.kind) from None
        tokenizer = self._llg_tokenizer()
        built: list[tuple[llguidance.LLMatcher, float]] = []  # (the matcher, when it was done)
        thread = threading.Thread(target=lambda: built.append(
            (llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self._parser_limits), time.monotonic())),
            name="blockserve-grammar-compile", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(self.limits.compile_timeout_s)
        # Past the cap is refused even when this thread was descheduled long enough to see it done.
        if not built or built[0][1] - started > self.limits.compile_timeout_s:
            raise InvalidRequest(f"compiling structured_outputs.{spec.kind} took longer than "
                                 f"{self.limits.compile_timeout_s:g} s; simplify it", param=spec.kind)
        matcher = built[0][0]
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()
            raise InvalidRequest(f"structured_outputs.{spec.kind} cannot be compiled: "
                                 f"{' '.join(line.strip() for line in reason[:6])}", param=spec.kind)
        compiled = CompiledGrammar(spec.kind, matcher, self.vocab_size, self.eos_token_id)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self.hf_tokenizer is None:
                    raise InvalidRequest("structured outputs need the model's tokenizer, and this model has none")
                self._tokenizer = llguidance_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_token_id)
            return self._tokenizer


def _source(spec: StructuredOutputsParams) -> str:
    value = getattr(spec, spec.kind)
    return "\x00".join(value) if spec.kind == "choice" else str(value)


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_token_id: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a Rust-backed one (`tokenizer.backend_tokenizer`: a transformers
    fast tokenizer or a GGUF one, models/gguf_tokenizer.py), serialised with its added tokens and
    without padding or truncation, as llguidance.hf does (without importing transformers);
    InvalidRequest for a tokenizer without a Rust backend."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise InvalidRequest(f"structured outputs are not available for this tokenizer ({type(tokenizer).__name__}): "
                             "they need a fast (Rust-backed) tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)
