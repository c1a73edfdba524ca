"""Checks that a recurrent kernel resumes exactly from a state it captured (hybrid prefix caching).

A kernel under test is `kernel(a, b, state, capture)`: the tokens at positions [a, b) from
`state` -> (outputs, final state), or with a capture list (outputs, final state, [states]).
"""

from __future__ import annotations

import functools

import torch

CUTS = [(), (37,), (37, 61), (5, 6), (32, 80), (1, 99)]  # where the scheduler splits a prefill
exact = functools.partial(torch.testing.assert_close, atol=0, rtol=0)  # bit for bit


def run_segments(kernel, lo, hi, cuts, state, capture=None):
    """Positions [lo, hi) from `state`, one kernel call per segment between `cuts`
    -> (outputs, final state, {p: captured state})."""
    edges = [lo, *(c for c in cuts if lo < c < hi), hi]
    outs, taken = [], {}
    for a, b in zip(edges, edges[1:]):
        if capture is None:
            o, state = kernel(a, b, state, None)
        else:
            here = [p for p in capture if a < p <= b]
            o, state, got = kernel(a, b, state, here)
            taken.update(zip(here, got))
        outs.append(o)
    return torch.cat(outs), state, taken


def assert_resumes_exactly(kernel, length, cuts, state, grid, ref_out, ref_states, atol):
    """Capturing at the `grid` positions changes nothing; the state captured at p is bit for bit
    the state after exactly [0, p), and resuming from it is bit for bit the run through p (under
    the same later cuts); outputs and captured states equal the token-by-token reference
    (`ref_out`, `ref_states[p]`) within `atol`."""
    out, final, taken = run_segments(kernel, 0, length, cuts, state, grid)
    through, through_final, _ = run_segments(kernel, 0, length, cuts, state)
    exact(out, through)
    exact(final, through_final)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-4)
    for p in grid:
        exact(taken[p], run_segments(kernel, 0, p, cuts, state)[1])
        torch.testing.assert_close(taken[p], ref_states[p], atol=atol, rtol=1e-4)
        rest, resumed, _ = run_segments(kernel, p, length, cuts, taken[p])
        exact(rest, through[p:])
        exact(resumed, through_final)


def assert_conv_captures(kernel, x, zero_state, cuts):
    """A short conv's state captured at any position p is its last K - 1 inputs before p, and
    resuming from it reproduces the outputs."""
    length, width = x.shape[0], zero_state.shape[1]
    out, _, taken = run_segments(kernel, 0, length, cuts, zero_state, list(range(1, length + 1)))
    history = torch.cat([zero_state.T, x])  # position p's state: the inputs at p - K + 1 .. p - 1
    for p in range(1, length + 1):
        exact(taken[p], history[p:p + width].T)
    for p in range(1, length):
        exact(run_segments(kernel, p, length, cuts, taken[p])[0], out[p:])
