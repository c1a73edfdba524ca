"""Where the GGUF blocks stop serving rows (models/row_crossover.py): the search on a fake clock,
and the loader's use of it on the real one."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from blockserve.config_args import add_config_arguments
from blockserve.engine.config import EngineConfig
from blockserve.models import row_crossover
from blockserve.models.quantized_linear import (
    EVERY_ROW,
    MAX_ROWS,
    QuantizedLinear,
    pack_blocks,
    use_quantized_linears,
)
from blockserve.models.row_crossover import ALWAYS, crossover_rows, shape_of
from blockserve.native.extension import quantized_matmul_ops
from tests.models.test_quantized_linear import layer_over, assert_float32_matmul, quantized

ops = quantized_matmul_ops()
pytestmark = pytest.mark.skipif(ops is None or not ops.simd_lanes(),
                                reason="the quantized kernel needs native kernels built with AVX-512 or AVX2")


class FakeGemm:
    def __init__(self, costs: FakeCosts, linear: QuantizedLinear):
        self.costs, self.out_features = costs, linear.out_features

    def __call__(self, x: torch.Tensor, out_rows: int | None = None) -> None:
        self.costs.record(self.out_features, "gemm", x.shape[0], 1.0, out_rows or self.out_features)


class FakeCosts:
    """Replaces the linears' two paths with calls that record what they would cost: the GEMM 1 s per
    row, the blocks 0.5 s per row up to a row count per shape (out_features) and `slower` s past it;
    `time_call` returns the recorded cost."""

    def __init__(self, linears, blocks_win_up_to: dict[int, int], slower: float = 2.0):
        self.calls: list[tuple[int, str, int]] = []  # (out_features, path, rows)
        self.out_rows: list[tuple[int, str, int, int]] = []  # (out_features, path, rows, output rows computed)
        self.cost = 0.0
        for linear in linears:
            def blocks(x, packed, out_rows, q4_1, layer=linear):
                assert packed.numel() == layer.packed.numel() * -(-out_rows // 4) // -(-layer.out_features // 4)
                faster = x.shape[0] <= blocks_win_up_to[layer.out_features]
                self.record(layer.out_features, "blocks", x.shape[0], 0.5 if faster else slower, out_rows)
            linear.kernel, linear.gemm = blocks, FakeGemm(self, linear)

    def record(self, out_features: int, path: str, rows: int, seconds_per_row: float, out_rows: int) -> None:
        self.calls.append((out_features, path, rows))
        self.out_rows.append((out_features, path, rows, out_rows))
        self.cost = seconds_per_row * rows

    def time_call(self, fn) -> float:
        fn()
        return self.cost


def linears_of(outs: list[int], activations: str = "float32") -> list[QuantizedLinear]:
    layers = []
    for i, out in enumerate(outs):
        raw, weight = quantized(out, 64, "Q4_1", seed=i)
        layers.append(layer_over(weight, None, pack_blocks(raw, "Q4_1"), "Q4_1",
                                      activations=activations))
    return layers


def test_each_shape_keeps_its_blocks_while_they_are_the_faster():
    """Per shape: the largest candidate the blocks win (up to the ceiling), ALWAYS where they win none;
    a shape's search, largest candidate first, stops at the first the blocks win."""
    layers = linears_of([8, 12, 16] * 3)  # three shapes, three layers each, in model order
    fake = FakeCosts(layers, {8: 32, 12: 0, 16: 1000})
    rows = crossover_rows(layers, ceiling=64, time_call=fake.time_call)
    assert rows == {shape_of(layers[0]): 32, shape_of(layers[1]): ALWAYS, shape_of(layers[2]): 64}
    tried = {(out, rows) for out, _, rows in fake.calls}
    assert {r for out, r in tried if out == 8} == {64, 32}  # won at 32: nothing below it
    assert {r for out, r in tried if out == 12} == {64, 32, 16, 8}
    assert {r for out, r in tried if out == 16} == {64}  # 128 is past the ceiling
    assert {path for _, path, _ in fake.calls} == {"blocks", "gemm"}
    shapes = tuple(shape_of(layer) for layer in layers)
    assert not any(key[0] == shapes for key in row_crossover.MEASURED)  # a fake clock's result is not kept


@pytest.mark.parametrize("slower, kept", [(row_crossover.GEMM_MARGIN - 0.05, 64), (row_crossover.GEMM_MARGIN + 0.05, 32)])
def test_the_gemm_takes_rows_only_by_more_than_the_margin(slower, kept):
    """Blocks a little slower than the GEMM (within GEMM_MARGIN) keep the rows: one shape on the GEMM
    would take the whole step off the decoder stack's one native call."""
    layers = linears_of([8, 8])
    fake = FakeCosts(layers, {8: 32}, slower=slower)
    assert crossover_rows(layers, ceiling=64, time_call=fake.time_call) == {shape_of(layers[0]): kept}


def test_small_batches_sweep_every_layer_and_large_ones_a_few():
    """Up to 16 rows the weights must stream from memory as in a step: every layer; past that a
    prefix of each shape (about SWEEP_ROW_LAYERS rows x layers)."""
    layers = linears_of([8] * 40)
    fake = FakeCosts(layers, {8: 0})  # the GEMM wins everywhere: every candidate is measured
    crossover_rows(layers, ceiling=128, time_call=fake.time_call)
    per_candidate = {rows: sum(1 for _, path, r in fake.calls if path == "blocks" and r == rows)
                     for rows in (8, 16, 32, 64, 128)}
    repeats = row_crossover.REPEATS
    assert per_candidate[8] == per_candidate[16] == 40 * repeats
    assert per_candidate[32] == 8 * repeats and per_candidate[128] == 2 * repeats


def test_past_16_rows_a_wide_layer_is_timed_on_its_first_output_rows():
    """A layer wider than SWEEP_MAX_OUT (an output head) is timed whole up to 16 rows (memory-bound),
    on its first SWEEP_MAX_OUT output rows past them (compute-bound), on both paths alike."""
    wide = row_crossover.SWEEP_MAX_OUT + 8
    layers = linears_of([8, wide])
    fake = FakeCosts(layers, {8: 0, wide: 0})  # the GEMM wins everywhere: every candidate is measured
    crossover_rows(layers, ceiling=64, time_call=fake.time_call)
    timed = {(path, rows, out_rows) for out, path, rows, out_rows in fake.out_rows if out == wide}
    assert timed == {(path, rows, wide if rows <= 16 else row_crossover.SWEEP_MAX_OUT)
                     for path in ("blocks", "gemm") for rows in (8, 16, 32, 64)}
    assert {out_rows for out, _, _, out_rows in fake.out_rows if out == 8} == {8}


def test_a_row_prefix_of_the_blocks_is_the_weights_first_rows():
    """_blocks and _gemm over the first output rows equal the float32 matmul with those rows."""
    layer = linears_of([20])[0]
    x = torch.randn(3, layer.in_features)
    expected = x @ layer.weight[:8].t()
    for run in (row_crossover._blocks, row_crossover._gemm):
        torch.testing.assert_close(run(layer, x, 8), expected, rtol=1e-5, atol=1e-4)


def test_the_loader_measures_once_per_process_and_a_fixed_value_stands(monkeypatch):
    """use_quantized_linears without max_rows sets each layer's from the measurement (between ALWAYS
    and the build's ceiling), kept for the next model of the same shapes; with max_rows it measures
    nothing; int8 (every row) is never measured."""
    def model_with_blocks():
        model = nn.Module()
        model.a, model.b = nn.Linear(64, 96, bias=False), nn.Linear(64, 32, bias=False)
        blocks = []
        for name, out in (("a", 96), ("b", 32)):
            raw, weight = quantized(out, 64, "Q4_1", seed=out)
            getattr(model, name).weight.data = weight
            blocks.append((f"{name}.weight", "Q4_1", raw))
        return model, blocks

    ceiling = MAX_ROWS["float32", ops.simd_lanes()]
    model, blocks = model_with_blocks()
    use_quantized_linears(model, blocks)
    measured = {model.a.max_rows, model.b.max_rows}
    assert measured <= {ALWAYS, *(c for c in row_crossover.CANDIDATES if c <= ceiling)}

    def must_not_measure(*args):
        raise AssertionError("measured again")
    monkeypatch.setattr(row_crossover, "_measure", must_not_measure)
    again, blocks = model_with_blocks()
    use_quantized_linears(again, blocks)
    assert (again.a.max_rows, again.b.max_rows) == (model.a.max_rows, model.b.max_rows)
    fixed, blocks = model_with_blocks()
    use_quantized_linears(fixed, blocks, max_rows=7)
    assert fixed.a.max_rows == fixed.b.max_rows == 7
    int8, blocks = model_with_blocks()
    use_quantized_linears(int8, blocks, activations="int8")
    assert int8.a.max_rows == int8.b.max_rows == EVERY_ROW
    x = torch.randn(ceiling + 1, 64)  # either side of the measured rows: the same matmul
    for rows in (1, model.a.max_rows, model.a.max_rows + 1):
        assert_float32_matmul(model.a(x[:rows]), x[:rows], model.a.weight)


def test_the_engine_setting_is_checked_and_reaches_the_command_line():
    with pytest.raises(ValueError, match="quantized_max_rows must be >= 0"):
        EngineConfig(quantized_max_rows=-1)
    assert EngineConfig(quantized_max_rows=0).quantized_max_rows == 0
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert parser.parse_args(["--quantized-max-rows", "16"]).quantized_max_rows == 16


def test_a_second_start_reads_the_machines_stored_measurement(monkeypatch, tmp_path):
    """The wall-clock measurement is stored under the cache root; a new process (MEASURED empty)
    reads it instead of timing again; other threads (another key) measure anew."""
    layers = linears_of([8, 12])
    monkeypatch.setattr(row_crossover, "MEASURED", {})
    rows = crossover_rows(layers, ceiling=64, cache=tmp_path)
    stored = list((tmp_path / "row-crossover").glob("*.json"))
    assert len(stored) == 1 and not list((tmp_path / "row-crossover").glob(".*"))  # no temporary left
    monkeypatch.setattr(row_crossover, "MEASURED", {})

    def must_not_measure(*args):
        raise AssertionError("measured again")
    monkeypatch.setattr(row_crossover, "_measure", must_not_measure)
    assert crossover_rows(layers, ceiling=64, cache=tmp_path) == rows
    monkeypatch.setattr(row_crossover, "MEASURED", {})
    with pytest.raises(AssertionError, match="measured again"):  # another ceiling: another key
        crossover_rows(layers, ceiling=32, cache=tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "not json", "other rows", "other key", "bad value"])
def test_a_corrupt_stored_measurement_is_ignored_and_measured_again(monkeypatch, tmp_path, caplog, damage):
    layers = linears_of([8, 12])
    monkeypatch.setattr(row_crossover, "MEASURED", {})
    monkeypatch.setattr(row_crossover, "_measure", lambda linears, ceiling, time_call: {
        shape_of(layers[0]): 16, shape_of(layers[1]): ALWAYS})
    rows = crossover_rows(layers, ceiling=64, cache=tmp_path)
    path, = (tmp_path / "row-crossover").glob("*.json")
    text = path.read_text()
    stored = json.loads(text)
    if damage == "truncated":
        path.write_text(text[:len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\xff\x00garbage")
    elif damage == "other rows":
        path.write_text(json.dumps({**stored, "rows": stored["rows"][:1]}))
    elif damage == "other key":
        path.write_text(json.dumps({**stored, "key": {**stored["key"], "threads": 99}}))
    else:
        path.write_text(json.dumps({**stored, "rows": [[*r[:3], 5] for r in stored["rows"]]}))
    monkeypatch.setattr(row_crossover, "MEASURED", {})
    remeasured = {shape_of(layers[0]): 32, shape_of(layers[1]): 8}
    monkeypatch.setattr(row_crossover, "_measure", lambda linears, ceiling, time_call: remeasured)
    with caplog.at_level("WARNING", logger=row_crossover.__name__):
        assert crossover_rows(layers, ceiling=64, cache=tmp_path) == remeasured != rows
    assert "ignored" in caplog.text or "unreadable" in caplog.text
    assert json.loads(path.read_text())["rows"] == [[*shape, r] for shape, r in remeasured.items()]  # rewritten
