"""transformers on the same GGUF (dequantised to fp32 by transformers itself), SDPA attention:

    hf-sequential / hf-batchB   `generate`, one prompt at a time or static batches of B prompts
                                (left padding + attention mask); also its batch-1 decode latency
    hf-continuous               continuous batching, `generate_batch` (paged KV cache, SDPA: it
                                runs on CPU in transformers 5.24)

Greedy with EOS disabled, so every prompt gets exactly max_tokens new tokens (checked).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from benchmarks.peers.run_result import RunResult, check_counts, timed
from blockserve.models.default_model import default_model_path

PAGE_SIZE = 256  # generate_batch's KV page, in tokens (ContinuousBatchingConfig's default)


def load_hf_model():
    """The bundled GGUF through transformers, fp32, SDPA (what both `generate` and `generate_batch` use)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


class HFGenerateRunner:
    """`generate` over batches of batch_size prompts, one after another."""

    def __init__(self, model, pad_token_id: int, batch_size: int, name: str, progress: bool):
        self.model, self.pad, self.batch_size, self.name, self.progress = model, pad_token_id, batch_size, name, progress

    @torch.inference_mode()
    def _generate(self, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.pad, temperature=None, top_p=None, top_k=None)
        new = out[:, width:].tolist()
        check_counts("transformers generate", new, max_tokens)
        return new

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
        batches = [prompts[i:i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]

        def go():
            tokens = []
            for batch in tqdm(batches, desc=self.name, unit="batch" if self.batch_size > 1 else "req",
                              disable=not self.progress or len(batches) < 2, leave=False):
                tokens += self._generate(batch, max_tokens)
            return tokens

        tokens, seconds, cpu, load = timed(go)
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load,
                         {"batch_size": self.batch_size, "num_batches": len(batches)}), tokens

    def itl(self, prompt: list[int], max_tokens: int) -> float:
        """Batch-1 seconds per token after the first: (time of max_tokens new tokens - time of 1) / (max_tokens - 1)."""
        _, one, _, _ = timed(lambda: self._generate([prompt], 1))
        _, all_, _, _ = timed(lambda: self._generate([prompt], max_tokens))
        return (all_ - one) / (max_tokens - 1)


class HFContinuousBatchingRunner:
    """`generate_batch` over all prompts at once. Its KV cache is sized like blockserve's (1.5x what
    the prompts need when all run at once; left to itself it sizes the cache from free memory, which
    on CPU takes gigabytes and seconds to allocate), max_batch_tokens = blockserve's step budget.
    Each call builds (and times) a fresh manager and cache; prefix sharing is on (its default)."""

    def __init__(self, model, max_batch_tokens: int, progress: bool):
        self.model, self.max_batch_tokens, self.progress = model, max_batch_tokens, progress

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        num_blocks = 1 + int(1.5 * sum(-(-(len(p) + max_tokens) // PAGE_SIZE) for p in prompts))
        cb_config = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks,
                                             max_batch_tokens=self.max_batch_tokens)
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=-1)  # -1: no EOS
        outputs, seconds, cpu, load = timed(lambda: self.model.generate_batch(
            prompts, generation_config=gen_config, continuous_batching_config=cb_config, warmup=False,
            progress_bar=self.progress))
        results = list(outputs.values())  # in the order of the prompts
        errors = [r.error for r in results if r.error is not None]
        if errors or len(results) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results; errors: {errors}")
        tokens = [list(r.generated_tokens) for r in results]
        check_counts("transformers generate_batch", tokens, max_tokens)
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load,
                         {"num_blocks": num_blocks, "page_size": PAGE_SIZE,
                          "max_batch_tokens": self.max_batch_tokens}), tokens
