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


class ConcatenatedStates:
    """What the book must hold: every row recorded, later ones replacing from their first position, a
    gap starting over, the last `max_rows` kept (one tensor, rebuilt on every step)."""

    def __init__(self, max_rows: int):
        self.max_rows, self.first, self.rows = max_rows, None, torch.zeros(0, 1)

    def record(self, first: int, rows: torch.Tensor) -> None:
        if self.first is None or not self.first <= first <= self.first + self.rows.shape[0]:
            self.first, self.rows = first, rows
        else:
            self.rows = torch.cat([self.rows[:first - self.first], rows])
        excess = self.rows.shape[0] - self.max_rows
        if excess > 0:
            self.first, self.rows = self.first + excess, self.rows[excess:]


def test_many_steps_hold_exactly_the_rows_recorded_in_a_bounded_number_of_chunks():
    """Steps of one to a few rows (decode, verification with rejections, a chunk of prefill), past the
    cap for long: the rows held are those recorded, and the tensors holding them stay few (a step
    does not rebuild, nor keep a tensor for every step it saw)."""
    generator = torch.Generator().manual_seed(0)
    states, expected = TargetStates(max_rows=64), ConcatenatedStates(max_rows=64)
    position, most_chunks = 0, 0
    for step in range(2000):
        n = int(torch.randint(1, 6, (), generator=generator)) if step % 97 else 150  # now and then a prefill chunk past the cap
        rows = torch.arange(position, position + n, dtype=torch.float32)[:, None] + step / 10_000
        record(states, "a", position, rows.flatten().tolist())
        expected.record(position, rows)
        rejected = int(torch.randint(0, n, (), generator=generator)) if n > 1 else 0
        position += n - rejected  # the next step starts at the first rejected draft
        assert (states.first("a"), states.end("a")) == (expected.first, expected.first + expected.rows.shape[0])
        most_chunks = max(most_chunks, states.num_chunks("a"))
    assert torch.equal(states.take("a", expected.first, states.end("a")), expected.rows)
    assert most_chunks <= 64  # at most one per row held: whole chunks before the cap are dropped


def test_recording_past_the_cap_copies_only_the_rows_recorded(monkeypatch):
    """A request that does not propose (a batch past disable_by_batch_size, a long prompt) records a
    row a step for long: no step concatenates the rows held."""
    states = TargetStates(max_rows=64)
    concatenated = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda tensors, *args, **kwargs: concatenated.append(len(tensors)) or
                        real_cat(tensors, *args, **kwargs))
    for position in range(1000):
        record(states, "a", position, [position])
    assert concatenated == []
    assert (states.first("a"), states.end("a"), states.num_chunks("a")) == (1000 - 64, 1000, 64)
    monkeypatch.undo()
    assert states.take("a", 1000 - 64, 1000).flatten().tolist() == list(range(1000 - 64, 1000))
