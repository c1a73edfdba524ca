"""Where a recurrent kernel may capture its state inside one call: the positions it checks.

A segment holds the tokens at absolute positions [start, start + length); a state "at p" is the
state after the tokens before p. A chunked scan captures at chunk ends, which lie on multiples
of its chunk length; a short conv can give its window at any position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_captures(capture: Sequence[int] | None, start: int, length: int, multiple: int = 1) -> None:
    """ValueError unless every position in `capture` is a multiple of `multiple` in (start, start + length]."""
    bad = [p for p in capture or () if p % multiple or not start < p <= start + length]
    if bad:
        which = f"multiples of {multiple} " if multiple > 1 else ""
        raise ValueError(f"capture positions must be {which}in ({start}, {start + length}], got {bad}")


def capture_targets(captures: Sequence[tuple[int, int]] | None) -> tuple[list[int] | None, torch.Tensor | None]:
    """A sequence's (position, checkpoint slot) captures as (positions for the kernels' `capture`,
    the slots their states go to); (None, None) when there are none."""
    if not captures:
        return None, None
    return [p for p, _ in captures], torch.tensor([slot for _, slot in captures], dtype=torch.int64)
