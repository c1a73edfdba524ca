"""Structured outputs: a request's output constrained by a grammar (llguidance).

    StructuredOutputsParams ─► grammar.py: the llguidance grammar text (JSON: json_bounds.py bounds its numbers)
                            ─► compiler.py: GrammarCompiler.compile (cached, time-capped) ─► CompiledGrammar
    worker, per request      ─► matcher.py: GrammarMatcher (fills the step's token bitmask, accepts tokens)
    sampler, per step        ─► worker/sampler.py: the bitmask, unpacked, -inf where forbidden (constrained rows only)
"""

from blockserve.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarLimits
from blockserve.structured.json_bounds import JsonBounds
from blockserve.structured.matcher import GrammarMatcher

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarLimits", "GrammarMatcher", "JsonBounds"]
