"""Where a request's recurrent states are checkpointed: positions on the stride, chosen once
per scheduled step from what the request's admission found.

    prompt      [.... hit ....|.. junction ..|......... prefill_end]   decode: ... | ... |
    captures                        J                 P (last multiple <= prefill_end)   D  D (spare)

    J  the junction: where the attention groups' hit ends (rounded down to the stride) when no
       checkpoint reaches it, so the next request sharing that prefix hits all of it
    P  the end of the prefill: the next turn of a conversation starts there; and, when the
       prefill ends exactly on the stride, one stride earlier too, the deepest point the same
       prompt sent again can restore (a hit must leave its last token to compute)
    D  while decoding, each stride boundary, into the request's one decode spare: when it
       finishes, the spare is the checkpoint its next turn restores. A step verifying drafts
       captures every boundary among its tokens, each into a slot of its own: the spare stays
       cached until the step's result, which drops the captures after a rejected draft and
       makes the deepest accepted one the spare (`state_manager.LinearStateManager`)
    K  optionally every `interval` strides inside the prefill (long documents)

Taking one never splits a step: the kernels capture inside their chunked scans.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapturePlan:
    stride: int
    prefill_end: int  # tokens known when the request was admitted
    junction: int = 0  # 0: none
    interval: int = 0  # strides between periodic prefill captures; 0: off

    def positions(self, start: int, end: int) -> tuple[list[int], bool]:
        """The capture positions in (start, end] for a step computing tokens [start, end), and
        whether they are decode-time captures (which go to the decode spare)."""
        stride = self.stride
        if start >= self.prefill_end:  # a decode, or one with drafts (every boundary among them)
            return list(range((start // stride + 1) * stride, end + 1, stride)), True
        wanted = {self.junction, self.prefill_end // stride * stride, (self.prefill_end - 1) // stride * stride}
        if self.interval:
            every = self.interval * stride
            wanted.update(range((start // every + 1) * every, end + 1, every))
        return sorted(p for p in wanted if start < p <= end), False
