"""How many rows a model's GGUF blocks should serve on this CPU, measured at load time.

A QuantizedLinear runs its blocks kernel up to `max_rows` rows and the GEMM over tiles dequantised
from the blocks past them.
Where the two cross depends on the CPU more than on the code (measured in docs/performance.md),
so the loader times both paths on the model's own layers and keeps the blocks while they are not
clearly slower:

    rows <= ALWAYS                 the blocks (bandwidth-bound: ahead of the GEMM wherever measured)
    candidate rows (CANDIDATES)    per layer shape, largest first (up to the build's MAX_ROWS):
                                   both paths over the model's layers in order; the first candidate
                                   the blocks win is the shape's max_rows (the crossover is taken as
                                   monotone), so where they win at the ceiling one candidate is measured

The blocks win a candidate unless the GEMM is faster by more than GEMM_MARGIN. The margin favours
the blocks because a decode step whose every layer takes them runs its decoder stack as one native
call, while one shape past its max_rows puts the whole step on the per-layer path, with that
shape's float32 weights (5x the bytes) on the GEMM.

Each candidate sweeps the layers in model order, so the weights stream from memory as in a real
step (a single layer timed in a loop sits in cache and flatters the GEMM at 8-16 rows); past 16
rows both paths are compute-bound and fewer layers suffice (SWEEP_ROW_LAYERS), and of a layer wider
than SWEEP_MAX_OUT only its first SWEEP_MAX_OUT output rows are timed (the rows are independent, so
both paths' times scale with them; a 49k-row output head timed whole was most of a load's
measurement, its memory too). Each path's time is
the fastest of REPEATS alternating sweeps. Results are kept per process (MEASURED), keyed by the
shapes, the activations, the ceiling and torch's thread count, so engines built alike in
one process choose alike (the choice moves results only by float rounding: the blocks and the
GEMM sum in different orders).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

ALWAYS = 4
CANDIDATES = (8, 16, 32, 64, 128)
GEMM_MARGIN = 1.2  # the blocks keep a candidate while their time is at most this times the GEMM's
SWEEP_ROW_LAYERS = 256  # past 16 rows, a sweep covers about this many rows x layers
SWEEP_MAX_OUT = 4096  # past 16 rows, the output rows of a layer timed (a multiple of the packed groups of 4)
REPEATS = 2

Shape = tuple[int, int, bool]  # (out_features, in_features, q4_1)
MEASURED: dict[tuple, dict[Shape, int]] = {}  # this process's measurements (see the module docstring)


def shape_of(linear) -> Shape:
    return linear.out_features, linear.in_features, linear.q4_1


def crossover_rows(linears: Sequence, ceiling: int,
                   time_call: Callable[[Callable[[], object]], float] | None = None) -> dict[Shape, int]:
    """Per shape of `linears` (QuantizedLinears in model order, one activations kind): the most rows
    up to `ceiling` the blocks serve no slower than GEMM_MARGIN times the tiled GEMM. `time_call(fn)` -> seconds (a
    test's fake clock); None: the wall clock, and the result kept for this process."""
    key = (tuple(shape_of(linear) for linear in linears), linears[0].activations if linears else None,
           ceiling, torch.get_num_threads())
    if time_call is None and key in MEASURED:
        return MEASURED[key]
    start = time.perf_counter()
    rows = _measure(linears, ceiling, time_call or _wall_seconds)
    if time_call is None:
        MEASURED[key] = rows
        logger.info("GGUF blocks serve up to %s rows per layer shape (out, in), the tiled GEMM past that "
                    "(measured in %.2f s at %d threads)", {s[:2]: r for s, r in rows.items()},
                    time.perf_counter() - start, torch.get_num_threads())
    return rows


def _wall_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _blocks(linear, x: torch.Tensor, out_rows: int) -> torch.Tensor:
    """x @ the first `out_rows` rows of the layer's weight, by its blocks kernel."""
    packed = linear.packed
    if out_rows < linear.out_features:  # whole groups of four rows lie one after another
        packed = packed[:packed.numel() // -(-linear.out_features // 4) * -(-out_rows // 4)]
    return linear.kernel(x, packed, out_rows, linear.q4_1)


def _gemm(linear, x: torch.Tensor, out_rows: int) -> torch.Tensor:
    return linear.gemm(x, out_rows)


def _first_of_each_shape(layers: Sequence, count: int) -> list:
    seen: Counter[Shape] = Counter()
    kept = []
    for linear in layers:
        seen[shape_of(linear)] += 1
        if seen[shape_of(linear)] <= count:
            kept.append(linear)
    return kept


def _measure(linears: Sequence, ceiling: int, time_call) -> dict[Shape, int]:
    best = {shape_of(linear): min(ALWAYS, ceiling) for linear in linears}
    open_shapes = set(best)
    with torch.inference_mode():
        for rows in sorted((c for c in CANDIDATES if c <= ceiling), reverse=True):
            if not open_shapes:
                break
            layers = [linear for linear in linears if shape_of(linear) in open_shapes]
            if rows > 16:  # compute-bound: the first few layers of each shape, in model order
                layers = _first_of_each_shape(layers, max(1, math.ceil(SWEEP_ROW_LAYERS / rows / len(open_shapes))))
            inputs = {linear.in_features: torch.randn(rows, linear.in_features) for linear in layers}
            out_rows = {linear: linear.out_features if rows <= 16 else min(linear.out_features, SWEEP_MAX_OUT)
                        for linear in layers}
            blocks = {shape: math.inf for shape in open_shapes}
            gemm = dict(blocks)
            for _ in range(REPEATS):
                for run, times in ((_blocks, blocks), (_gemm, gemm)):
                    spent: Counter[Shape] = Counter()
                    for linear in layers:
                        x = inputs[linear.in_features]
                        spent[shape_of(linear)] += time_call(lambda: run(linear, x, out_rows[linear]))
                    for shape, seconds in spent.items():
                        times[shape] = min(times[shape], seconds)
            for shape in list(open_shapes):
                if blocks[shape] <= GEMM_MARGIN * gemm[shape]:
                    best[shape] = rows
                    open_shapes.discard(shape)
    return best
