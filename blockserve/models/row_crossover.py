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

A measurement is also kept per machine, one small JSON file per key under the project's cache root
(cached_directory.cache_root):

    <cache>/row-crossover/<digest>.json   {"key": {...}, "rows": [[out, in, q4_1, max_rows], ...]}

keyed by the CPU's model name and flags, the native build (models' kernels' sources, ISA flags,
torch: native/extension.build_key), the Python sources that time and choose (this module and
quantized_linear.py, tiled_gemm.py), the shapes, the activations, the ceiling and the thread count; so a second
start on the same machine reads it instead of timing again. Files are written whole through a
renamed temporary (safe to share between processes); one that does not parse, or whose key or rows
do not fit the request, is ignored with a warning and measured again; a read-only cache is read but
not written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from blockserve.cached_directory import cache_root, write_atomically

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
                   time_call: Callable[[Callable[[], object]], float] | None = None,
                   cache: Path | None = None) -> dict[Shape, int]:
    """Per shape of `linears` (QuantizedLinears in model order, one activations kind): the most rows
    up to `ceiling` the blocks serve no slower than GEMM_MARGIN times the tiled GEMM. `time_call(fn)` -> seconds (a
    test's fake clock); None: the wall clock, and the result kept for this process and in the
    machine's cache under `cache` (None: cache_root())."""
    key = (tuple(shape_of(linear) for linear in linears), linears[0].activations if linears else None,
           ceiling, torch.get_num_threads())
    if time_call is None and key in MEASURED:
        return MEASURED[key]
    stored = None
    if time_call is None:
        stored = _stored_path(cache or cache_root(), machine_key := _machine_key(key))
        if (rows := _read_stored(stored, machine_key, set(key[0]), ceiling)) is not None:
            MEASURED[key] = rows
            return rows
    start = time.perf_counter()
    rows = _measure(linears, ceiling, time_call or _wall_seconds)
    if stored is not None:
        MEASURED[key] = rows
        _write_stored(stored, machine_key, rows)
        logger.info("GGUF blocks serve up to %s rows per layer shape (out, in), the tiled GEMM past that "
                    "(measured in %.2f s at %d threads)", {s[:2]: r for s, r in rows.items()},
                    time.perf_counter() - start, torch.get_num_threads())
    return rows


def _machine_key(key: tuple) -> dict:
    """What a stored measurement is valid for: this process's key plus the machine and the code."""
    from blockserve.native.extension import build_key

    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in ("row_crossover.py", "quantized_linear.py",
                                                                     "tiled_gemm.py")))
    return {"cpu": _cpu_identity(), "native_build": build_key(), "code": code.hexdigest()[:16],
            "shapes": [list(shape) for shape in key[0]], "activations": key[1], "ceiling": key[2], "threads": key[3]}


def _cpu_identity() -> str:
    """The CPU's model name and flags (/proc/cpuinfo's first processor), or the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return f"{platform.machine()} {platform.processor()}"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")
    return f"{model}; {flags}"


def _stored_path(root: Path, machine_key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(machine_key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "row-crossover" / f"{digest}.json"


def _read_stored(path: Path, machine_key: dict, shapes: set[Shape], ceiling: int) -> dict[Shape, int] | None:
    """The rows stored at `path` for `machine_key`; None where there is no file, or (with a warning)
    where it does not parse or does not fit: a different key, other shapes, a row count no
    measurement gives."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning("row crossover cache %s unreadable (%s): measuring again", path, error)
        return None
    allowed = {min(ALWAYS, ceiling), *(c for c in CANDIDATES if c <= ceiling)}
    try:
        stored = json.loads(text)  # UnicodeDecodeError is a ValueError
        if stored["key"] != machine_key:
            raise ValueError("its key is not this machine's and model's")
        rows = {}
        for out, inp, q4_1, max_rows in stored["rows"]:
            if not (type(out) is type(inp) is type(max_rows) is int and type(q4_1) is bool and max_rows in allowed):
                raise ValueError(f"entry {[out, inp, q4_1, max_rows]} is not a measurement")
            rows[(out, inp, q4_1)] = max_rows
        if set(rows) != shapes:
            raise ValueError("its shapes are not the model's")
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("row crossover cache %s ignored (%s): measuring again", path, error)
        return None
    return rows


def _write_stored(path: Path, machine_key: dict, rows: dict[Shape, int]) -> None:
    try:
        write_atomically(path, json.dumps({"key": machine_key, "rows": [[*shape, r] for shape, r in rows.items()]}))
    except OSError as error:  # a read-only cache still serves what it holds
        logger.debug("could not store the row crossover in %s: %s", path, error)


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
