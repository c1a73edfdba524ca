"""The MTP proposer's book of target hidden states (worker/mtp_proposer.py, TargetStates): rows of a
later step replace those held from their first position on (a verification's rejected drafts, a
recomputation), a gap starts the book over, taking keeps the last row taken, and the held rows are
bounded, the oldest dropped."""

from __future__ import annotations

import pytest
import torch

from blockserve.worker.mtp_proposer import TargetStates


def record(states: TargetStates, request_id: str, first: int, values) -> None:
    """A step's rows for one request from position `first`, each row's value saying which it is."""
    states.record([request_id], [0, len(values)], [first], torch.tensor([[float(v)] for v in values]))


def test_a_later_step_replaces_the_rows_from_its_first_position():
    states = TargetStates()
    record(states, "a", 0, [0, 1, 2, 3])
    record(states, "a", 4, [4, -5, -6, -7])  # a verification: its last three rows followed rejected drafts
    record(states, "a", 5, [5, 6])  # the next step starts at the first rejected one
    assert (states.first("a"), states.end("a")) == (0, 7)
    assert states.take("a", 2, 7).flatten().tolist() == [2, 3, 4, 5, 6]
    assert (states.first("a"), states.end("a")) == (6, 7)  # the last row taken stays
    record(states, "a", 3, [3, 4, 5])  # a recomputation from a prefix-cache hit before what is held
    assert (states.first("a"), states.end("a")) == (3, 6)


def test_a_gap_starts_the_book_over_and_forget_drops_it():
    states = TargetStates()
    record(states, "a", 0, [0, 1])
    record(states, "a", 5, [5, 6])
    assert (states.first("a"), states.end("a")) == (5, 7)
    states.forget("a")
    assert states.first("a") is None and len(states) == 0


def test_the_rows_held_are_bounded_the_oldest_dropped():
    states = TargetStates(max_rows=4)
    record(states, "a", 0, range(3))
    record(states, "a", 3, range(3, 6))
    assert (states.first("a"), states.end("a")) == (2, 6)
    assert states.take("a", 2, 6).flatten().tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="max_rows"):
        TargetStates(max_rows=1)
