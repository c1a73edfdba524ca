"""llama.cpp through llama-cpp-python's low-level API, on the bundled Q4_1 GGUF as shipped.

    batched     one context with n_seq_max = the number of prompts, each prompt its own seq_id
                (with its own n_ctx / n_seq_max cells: kv_unified off, llama.cpp's default); all
                prompts' tokens go in first (n_batch tokens per llama_decode, logits only at each
                prompt's last token), then every step is one llama_decode with one token per sequence
    sequential  a one-sequence context, the prompts one after another, its memory cleared between them

Greedy (argmax of llama_get_logits_ith), EOS ignored: exactly max_tokens new tokens per sequence.
The weights are 4-bit, so the tokens differ from the fp32 systems' ones. Importing this module
raises ImportError (or OSError/RuntimeError for a broken build) without llama-cpp-python.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import llama_cpp
import numpy as np

from benchmarks.peers.run_result import RunResult, check_counts, timed

_WARN, _ERROR = 3, 4  # ggml_log_level values


@llama_cpp.llama_log_callback
def _warnings_only(level, text, user_data):
    if level in (_WARN, _ERROR):
        print(text.decode(errors="replace"), end="", flush=True)


class LlamaCppModel:
    """The GGUF loaded once; contexts and generations on it."""

    def __init__(self, path: Path, threads: int, n_batch: int):
        llama_cpp.llama_log_set(_warnings_only, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads, self.n_batch = threads, n_batch
        self.version = llama_cpp.__version__

    def context(self, n_seq: int, seq_len: int):
        """A context for n_seq sequences of up to seq_len tokens each; free it with llama_free."""
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = n_seq
        params.n_ctx = n_seq * -(-seq_len // 256) * 256  # n_ctx / n_seq_max cells each, padded to 256 by llama.cpp
        params.n_batch = max(self.n_batch, n_seq)
        params.n_ubatch = min(512, params.n_batch)
        params.n_threads = params.n_threads_batch = self.threads
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} x {seq_len} tokens")
        return ctx

    def generate(self, ctx, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
        """Greedy max_tokens tokens for every prompt, as parallel sequences 0..n-1 of ctx (whose
        memory must hold none of them); also the perf_counter time at which each step's tokens were
        sampled (the first: after the prompts)."""
        size = max(self.n_batch, len(prompts))
        batch = llama_cpp.llama_batch_init(size, 0, 1)
        try:
            entries = [(seq, pos, token, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, token in enumerate(p)]
            first = [0] * len(prompts)
            for start in range(0, len(entries), size):
                chunk = entries[start:start + size]
                self._decode(ctx, batch, chunk)
                for i, (seq, _, _, logits) in enumerate(chunk):
                    if logits:
                        first[seq] = self._argmax(ctx, i)
            tokens = [[t] for t in first]
            times = [time.perf_counter()]
            for step in range(1, max_tokens):
                self._decode(ctx, batch, [(seq, len(p) + step - 1, tokens[seq][-1], True) for seq, p in enumerate(prompts)])
                for seq, out in enumerate(tokens):
                    out.append(self._argmax(ctx, seq))
                times.append(time.perf_counter())
        finally:
            llama_cpp.llama_batch_free(batch)
        return tokens, times

    @staticmethod
    def _decode(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (seq_id, position, token, wants logits) entries."""
        for i, (seq, pos, token, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, ctx, i: int) -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)).argmax())


class LlamaCppRunner:
    """One llama.cpp system: batched (all prompts as parallel sequences) or sequential."""

    def __init__(self, model: LlamaCppModel, sequential: bool):
        self.model, self.sequential = model, sequential

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
        n_seq = 1 if self.sequential else len(prompts)
        ctx = self.model.context(n_seq, max(map(len, prompts)) + max_tokens)  # not timed, like a fresh blockserve engine

        def go():
            if not self.sequential:
                return self.model.generate(ctx, prompts, max_tokens)[0]
            tokens = []
            for prompt in prompts:
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                tokens += self.model.generate(ctx, [prompt], max_tokens)[0]
            return tokens

        try:
            tokens, seconds, cpu, load = timed(go)
        finally:
            llama_cpp.llama_free(ctx)
        check_counts("llama.cpp", tokens, max_tokens)
        extra = {"parallel_sequences": n_seq, "n_threads": self.model.threads, "n_batch": max(self.model.n_batch, n_seq)}
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load, extra), tokens

    def itl(self, prompt: list[int], max_tokens: int) -> float:
        """Batch-1 seconds per token after the first: (last token's time - first's) / (max_tokens - 1)."""
        ctx = self.model.context(1, len(prompt) + max_tokens)
        try:
            times = self.model.generate(ctx, [prompt], max_tokens)[1]
        finally:
            llama_cpp.llama_free(ctx)
        return (times[-1] - times[0]) / (max_tokens - 1)
