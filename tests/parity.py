"""Greedy parity with transformers, the one rule every family's model and engine tests hold
blockserve to: transformers' own model on the same weights is the reference, in float32.

    reference = reference_outputs(hf_model, prompts, new_tokens)   # its greedy tokens and log-probs
    assert_greedy_parity(our_tokens, reference)                    # equal tokens (near-ties: opt-in)
    assert_logits_close(our_prompt_logits, reference_logits(hf_model, prompts), atol=1e-4, rtol=0)
"""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_outputs(reference, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list]]:
    """Per prompt: transformers' greedy `new_tokens` tokens (never stopping at an end-of-sequence
    token, as the paged harness and `ignore_eos` do not), and the log-softmax of its logits at each
    of those steps (the near-tie rule's reference)."""
    out = []
    for p in prompts:
        result = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                    output_logits=True, return_dict_in_generate=True)
        out.append((result.sequences[0, len(p):].tolist(), [step[0].log_softmax(-1) for step in result.logits]))
    return out


def greedy_tokens(reference: list[tuple[list[int], list]]) -> list[list[int]]:
    """The tokens alone of `reference_outputs`."""
    return [tokens for tokens, _ in reference]


@torch.no_grad()
def reference_logits(reference, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits at every position of each prompt, [L, vocab], one forward per prompt."""
    return [reference(torch.tensor([p])).logits[0] for p in prompts]


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor], *, atol: float, rtol: float) -> float:
    """Each prompt's logits within `atol` + `rtol` x |reference| of `reference_logits`; returns the
    largest absolute difference."""
    assert len(got) == len(want), f"{len(got)} prompts' logits, transformers {len(want)}"
    worst = 0.0
    for ours, theirs in zip(got, want):
        worst = max(worst, float((ours - theirs).abs().max()))
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol)
    return worst


def assert_greedy_parity(got: list[list[int]], reference, *, max_near_ties: int = 0, close: float = 0.0) -> int:
    """Greedy tokens equal the reference's (`reference_outputs`), except near-ties, and at most
    `max_near_ties` of them (0, the default: equality). A near-tie: at the first position where a
    sequence differs, both tokens are in the reference's top 5 and their reference log-probabilities
    are under `close` nats apart; what follows it is not compared. A failure names the position and
    that gap (a flipped near-tie, or a bug). Prints how many sequences needed the rule, with their
    gaps, and returns the count."""
    assert len(got) == len(reference)
    gaps = []
    for i, (tokens, (want, want_logprobs)) in enumerate(zip(got, reference)):
        assert len(tokens) == len(want), f"sequence {i}: {len(tokens)} tokens, transformers {len(want)}"
        if tokens == want:
            continue
        j = next(k for k, (a, b) in enumerate(zip(tokens, want)) if a != b)
        logprobs = want_logprobs[j]
        gap = float(logprobs[want[j]] - logprobs[tokens[j]])
        assert max_near_ties and tokens[j] in logprobs.topk(5).indices.tolist() and gap < close, (
            f"sequence {i}, token {j}: {tokens[j]}, transformers {want[j]} (reference log-probability gap "
            f"{gap:.2e}; {f'a near-tie is under {close}' if max_near_ties else 'no near-tie allowed'})\n"
            f" ours   {tokens}\n theirs {want}")
        gaps.append(gap)
    print(f"\ngreedy parity: {len(got) - len(gaps)}/{len(got)} identical, {len(gaps)} near-ties "
          f"(at most {max_near_ties}){', gaps ' + ', '.join(f'{g:.1e}' for g in gaps) if gaps else ''}")
    assert len(gaps) <= max_near_ties, f"{len(gaps)} near-ties (gaps {gaps}), more than the {max_near_ties} allowed"
    return len(gaps)


def assert_logprobs_close(outputs, reference, *, tolerance: float = 1e-4) -> float:
    """Each step's log-probabilities (of the sampled token and its top alternatives) in the engine's
    RequestOutputs within `tolerance` of the reference's (`reference_outputs`); the largest difference."""
    worst = 0.0
    for output, (_, want_steps) in zip(outputs, reference, strict=True):
        steps = output.outputs[0].logprobs
        assert len(steps) == len(want_steps)
        for step, want in zip(steps, want_steps):
            assert len(step) >= 5
            for token, logprob in step.items():
                difference = abs(logprob.logprob - float(want[token]))
                assert difference < tolerance, (token, logprob, float(want[token]))
                worst = max(worst, difference)
    return worst
