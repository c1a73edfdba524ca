"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the
first, its log-probability given the tokens before it, with the top n, for the requests that ask.

    prompt        t0   t1   t2   t3 | t4   t5          two prefill chunks
    hidden at     h0   h1   h2   h3 | h4   h5          h_i's logits score t_{i+1}
    entry for     -    t1   t2   t3 | t4   t5          h5 samples the first output token
                 None

Chunks add their entries as they run; the request gets the list once its prompt is complete
(with its first sampled token). Logprobs are raw: the log-softmax of the model's logits, before
penalties, temperature and filters (as vLLM's). Tokens served from the prefix cache were never
run through the model here, so they have no logits: the scheduler admits a request that asks
for prompt logprobs without a prefix hit (vLLM's choice; its computed blocks are still cached
for others). A request preempted before its prompt completes is dropped here and recomputed
from its first token; one preempted later already has its entries.

Nothing is read back while a step is launched (async scheduling overlaps the next step's host work
with the device): each pass's logprobs start on their way to the host, and a request's entries are
read when its step's result is (`read_entries`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockserve.scheduler.output import SchedulerOutput
from blockserve.worker.input_batch import CachedRequest, StepInputs
from blockserve.worker.sampler import TokenLogprobs, copy_to_host_async

LOGITS_ROWS_PER_PASS = 256  # prompt positions turned into [rows, vocab] logits at a time (bounds memory)


@dataclass
class _Pass:
    """One pass's logprobs: each row's target's, and the top n (None: n = 0). On CUDA they are
    copied to pinned host memory as the pass is computed, and `ready` says when the copies are done:
    reading them waits for this pass only, not for a step launched since (async scheduling)."""

    picked: torch.Tensor  # [rows]
    top_ids: torch.Tensor | None  # [rows, n]
    top_logprobs: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    _host: tuple[list, list, list] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, picked: torch.Tensor, top: torch.return_types.topk | None) -> _Pass:
        tensors = [picked] if top is None else [picked, top.indices, top.values]
        ready = None
        if picked.device.type != "cpu":
            tensors, ready = copy_to_host_async(tensors)
        return cls(tensors[0], *(tensors[1:] or (None, None)), ready)

    def host(self) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """(picked, top ids, top logprobs) per row, read on the first call."""
        if self._host is None:
            if self.ready is not None:
                self.ready.synchronize()
            picked = self.picked.tolist()
            if self.top_ids is None:
                self._host = picked, [[]] * len(picked), [[]] * len(picked)
            else:
                self._host = picked, self.top_ids.tolist(), self.top_logprobs.tolist()
        return self._host


Entry = tuple[_Pass, int, int]  # (its pass, its row there, the request's n)


def read_entries(entries: list[Entry]) -> list[TokenLogprobs]:
    """A request's entries (`PromptLogprobs.take`), read back: waits for the steps that computed them."""
    out = []
    for rows, row, k in entries:
        picked, ids, lps = rows.host()
        out.append(TokenLogprobs(picked[row], ids[row][:k], lps[row][:k]))
    return out


class PromptLogprobs:
    """The entries computed so far of each running request that asked, by request id."""

    def __init__(self):
        self._entries: dict[str, list[Entry]] = {}

    def update(self, out: SchedulerOutput) -> None:
        """Forget finished and preempted requests; start the new ones that ask and have not sampled yet."""
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self._entries.pop(rid, None)
        for new in out.new_requests:
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                if new.num_computed_tokens:
                    raise RuntimeError(f"request {new.request_id} asks for prompt logprobs but was admitted with a "
                                       f"prefix hit of {new.num_computed_tokens} tokens, which have no logits")
                self._entries[new.request_id] = []

    def compute(self, model: torch.nn.Module, hidden: torch.Tensor, inputs: StepInputs,
                requests: dict[str, CachedRequest]) -> None:
        """Add the entries of this step's prompt chunks (`hidden` [T, H] is the step's output;
        `inputs.prepare` has advanced each request's computed count past its chunk)."""
        if not self._entries:
            return
        rows, targets, owners = [], [], []
        starts = inputs.query_start
        for i, rid in enumerate(inputs.request_ids):
            if rid not in self._entries:
                continue
            request = requests[rid]
            n = starts[i + 1] - starts[i]
            first = request.num_computed - n  # position of the chunk's first token
            last = min(request.num_computed, len(request.prompt_token_ids) - 1)  # positions < last score a prompt token
            if last <= first:
                continue
            rows.extend(range(starts[i], starts[i] + last - first))
            targets.extend(request.prompt_token_ids[first + 1 : last + 1])
            owners.extend([rid] * (last - first))
        if not rows:
            return
        top_n = max(requests[rid].params.prompt_logprobs for rid in set(owners))
        for lo in range(0, len(rows), LOGITS_ROWS_PER_PASS):
            hi = lo + LOGITS_ROWS_PER_PASS
            index = torch.tensor(rows[lo:hi], dtype=torch.long, device=hidden.device)
            logits = model.compute_logits(hidden[index])
            if logits is None:  # a tensor-parallel rank > 0: it took part in the gather; rank 0 keeps the entries
                continue
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(targets[lo:hi], dtype=torch.long, device=hidden.device)
            rows_pass = _Pass.start(logprobs.gather(1, target.unsqueeze(1)).squeeze(1),
                                    logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1) if top_n else None)
            for row, rid in enumerate(owners[lo:hi]):
                self._entries[rid].append((rows_pass, row, requests[rid].params.prompt_logprobs))

    def take_all(self, request_ids) -> dict[str, list[Entry]]:
        """`take` for each of `request_ids`, those that asked only."""
        if not self._entries:  # most steps: nobody asked
            return {}
        return {rid: entries for rid in request_ids if (entries := self.take(rid)) is not None}

    def take(self, request_id: str) -> list[Entry] | None:
        """The entries of a request whose prompt just completed (one per prompt token after the
        first; `read_entries` reads them), or None if it did not ask; it is forgotten here."""
        return self._entries.pop(request_id, None)
