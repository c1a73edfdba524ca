"""When drafts pay: the measured seconds of a decode step by its row count, weighed against the
tokens the drafts are expected to add.

A decode step that scores R rows (one per request, plus each request's drafts) takes c(R) seconds,
measured on the engine's own steps (an exponential average per row count). Drafts are accepted left
to right, so k drafts of a request whose drafts are accepted at rate a per position add, in
expectation, a + a^2 + ... + a^k tokens, for c(R + k) - c(R) more seconds. Plain decoding of a batch of
B requests emits B / c(B) tokens per second; drafts pay when they add tokens at a better rate than
that. `best_drafts` picks the k of largest expected gain at that price, 0 when none gains.

Where a batch's plain step is not measured, no drafts are verified (so the next step measures it);
a larger row count never measured counts as free, so it is tried and measured. A count not measured
for STALE_AFTER observations is forgotten (what a step costs changes with the CPU's load)."""

from __future__ import annotations

SMOOTHING = 0.25  # weight of a new observation in a row count's average
STALE_AFTER = 512  # observations after which an unrefreshed row count is measured again


class StepCosts:
    """Seconds per decode step by row count; `seconds(rows)` None where unknown."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._seen_at: dict[int, int] = {}
        self._observations = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds`."""
        if rows < 1 or seconds < 0:
            raise ValueError(f"a step of {rows} rows cannot take {seconds} s")
        self._observations += 1
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + SMOOTHING * (seconds - old)
        self._seen_at[rows] = self._observations
        for stale in [r for r, at in self._seen_at.items() if self._observations - at > STALE_AFTER]:
            del self._seconds[stale], self._seen_at[stale]

    def seconds(self, rows: int) -> float | None:
        """c(rows): measured, or interpolated between the nearest measured row counts either side;
        None where no count is measured on one side (not known)."""
        measured = self._seconds
        if rows in measured:
            return measured[rows]
        below = max((r for r in measured if r < rows), default=None)
        above = min((r for r in measured if r > rows), default=None)
        if below is None or above is None:
            return None
        share = (rows - below) / (above - below)
        return measured[below] + share * (measured[above] - measured[below])

    def best_drafts(self, available: int, acceptance: float, batch_size: int, rows: int) -> int:
        """How many of `available` drafts to verify in a step of `batch_size` requests that already
        scores `rows` rows, for a request whose drafts are accepted at rate `acceptance` per position:
        the k of largest expected tokens gained less the plain rate's tokens for the seconds added."""
        base, plain = self.seconds(rows), self.seconds(batch_size)
        if plain is None:
            return 0  # the plain step first: what the drafts' rows are weighed against
        rate = batch_size / plain if plain > 0 else 0.0  # plain decoding's tokens per second
        best, best_gain = 0, 0.0
        expected = 0.0
        for k in range(1, available + 1):
            expected += acceptance ** k
            cost = self.seconds(rows + k)
            added = 0.0 if cost is None or base is None else max(cost - base, 0.0)  # (noise: never a saving)
            gain = expected - rate * added
            if gain > best_gain:
                best, best_gain = k, gain
        return best


class FlatStepCosts(StepCosts):
    """Every step costs the same whatever its rows, so every draft pays while the request's acceptance
    is above the speculator's floor: for drivers whose steps' time means nothing (the shadow simulator)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def seconds(self, rows: int) -> float | None:
        return 1.0
