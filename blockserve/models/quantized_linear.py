"""Linear layers that hold a GGUF weight in Q4_0 / Q4_1 / Q8_0 blocks only, with no float32 copy.

The file's Q4_0 / Q4_1 and Q8_0 blocks encode the weights in 0.75 and 1.125 bytes per weight (as
packed here) instead of float32's 4, and a small-batch decode step is bound by reading weights,
so the native kernels (native/csrc/quantized_matmul.cpp) read the blocks. `activations` picks one of three:

    "float32"  the weights dequantised in registers, float32 x: exact up to float rounding, so the
               model gives transformers' logits and greedy tokens. The default
               (DEFAULT_ACTIVATIONS). Compute-bound past a few rows, so the float32 GEMM takes
               larger batches.
    "int8"     x rounded to int8 per block of 32 and integer dot products, as llama.cpp computes
               a GGUF's matmuls on CPU (--quantized-activations int8); it serves every row count.
               Each matmul is off x @ W^T by up to sum_k |w_k| * max|x_block| / 254. The rounding
               is discontinuous: a float-rounding difference upstream (another chunking of a
               prefill: a prefix-cache hit, a batch) can move an element one level, and over the
               layers such moves add up: logprobs move with caching and batching orders of
               magnitude more than under "float32".
    "int16"    x rounded to int16 per block of 32 (levels of max|x_b| / 32767) and integer dot
               products of 16-bit pairs (--quantized-activations int16): 256 times finer than int8
               for about twice its multiplies; off x @ W^T by up to sum_k |w_k| * max|x_block| / 65534.

Their speed and their drift from transformers' logits are measured in docs/performance.md.

    float32:  rows <= max_rows   x @ W^T over the blocks (max_rows: where the GEMM starts to beat
                                 them clearly on this CPU, measured as the model loads; at most MAX_ROWS)
              rows >  max_rows   the GEMM over tiles dequantised from the blocks (QuantizedLinear.gemm,
                                 tiled_gemm.py: one cache-resident tile at a time, then dropped)
    int8:     every row count    the int8 kernel (row tiles of 128 inside it); the tiled GEMM on x
                                 rounded as the kernel rounds it (`round_per_block`) only where the
                                 kernel cannot run (no native build, x not a 2-D float32 CPU tensor)
    int16:    rows <= max_rows   the int16 kernel (float32's max_rows)
              rows >  max_rows   the tiled GEMM on x rounded as the kernel rounds it (also where
                                 the kernel cannot run)

Under "int8", and "int16" up to max_rows, a matmul row's result is the same bits whatever shares its
call (each output is the same integer block dots summed in the same order); under "float32", and
"int16" past max_rows, the same up to float rounding (~1e-6): the blocks and the GEMM sum in
different orders.

The kernel reads Q4_1 (w = d * q + m), Q4_0 (w = d * (q - 8), packed as Q4_1 with m = -8 d)
and Q8_0 (w = d * q), d and m float16; the other block formats run from the file's own blocks
(gguf_block_linear.py).

Tensor-parallel: each rank keeps the blocks of its own shard (`narrow_blocks` of the column- and
row-parallel layers, tensor_parallel/layers.py); a row-parallel layer's partial product is
all-reduced. The tied LM head stays the vocab-parallel float32 one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from blockserve.native.extension import quantized_matmul_ops
from blockserve.native.gate import native_reads
from blockserve.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from blockserve.models.row_crossover import crossover_rows, shape_of
from blockserve.models.tiled_gemm import tiled_gemm
from blockserve.models.weights import GATE_UP, QKV

logger = logging.getLogger(__name__)

# The most rows the blocks serve a layer, by (activations, the kernel's SIMD lanes: 16 on AVX-512, 8
# on AVX2); as a model loads, each layer's max_rows is measured at or below it (models/row_crossover.py).
# float32 and int16: past these rows the float32 GEMM keeps pace (int16: on x rounded as the kernel
# rounds it), so a decode step up to them is one native call and larger batches take the GEMM.
# int8 serves every row count (EVERY_ROW), so its rows get the same bits whatever the batch.
# native/csrc/paged_decode.cpp's kPoolSeqs follows the float32 rows per build (pool_sequences(); tested).
# Measured in docs/performance.md.
EVERY_ROW = 2 ** 62
MAX_ROWS = {("int8", 16): EVERY_ROW, ("int8", 8): EVERY_ROW, ("float32", 16): 128, ("float32", 8): 64,
            ("int16", 16): 128, ("int16", 8): 64}
ACTIVATIONS = ("float32", "int8", "int16")  # EngineConfig.quantized_activations' choices (engine/config.py)
LEVELS = {"int8": 127, "int16": 32767}  # the integer activations' levels either side of zero
KERNELS = {"float32": "quantized_matmul", "int8": "quantized_matmul_int8", "int16": "quantized_matmul_int16"}
DEFAULT_ACTIVATIONS = "float32"  # and its default (engine/config.py's DEFAULT_QUANTIZED_ACTIVATIONS)

GROUP = 4  # output rows packed together (the kernel's layout)
FORMATS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # GGUF block bytes per 32 weights
NIBBLES = ("Q4_0", "Q4_1")  # packed in the kernel's Q4_1 layout
PACKED_BYTES = {"Q4_0": 96, "Q4_1": 96, "Q8_0": 144}  # per group of four rows and block of 32 columns

# GGUF files hold Llama-family models: Hugging Face projection -> (our fused one, its index, parts), as llama.py fuses
FUSED = {part: (group.target, i, len(group.parts)) for group in (QKV, GATE_UP) for i, part in enumerate(group.parts)}


def pack_blocks(raw: np.ndarray, format: str) -> torch.Tensor:
    """GGUF blocks [N, K / 32 * block bytes] uint8 -> the kernel's packed layout (see the .cpp):
    per group of four output rows and per block, the four scales (and mins) as float32, then the
    four rows' quantized values. N is padded to a multiple of four with zero rows. Each field is
    copied once, straight into its place in the output."""
    rows = raw.shape[0]
    nblocks = raw.shape[1] // FORMATS[format]
    blocks = raw.reshape(rows, nblocks, FORMATS[format])
    groups = -(-rows // GROUP)
    quants = blocks[..., 4 if format == "Q4_1" else 2:]  # after the float16 d (Q4_1: and m)
    scales = 1 if format == "Q8_0" else 2  # float32 fields per row: d, and the min (Q4_0's: -8 d, exact)
    width = GROUP * (4 * scales + quants.shape[-1])
    packed = np.zeros((groups, nblocks, width), np.uint8)  # padding rows stay zero

    def place(start: int, field_bytes: int, dtype, values: np.ndarray) -> np.ndarray:
        """`values` [rows, nblocks, ...] copied into their field of `packed`; that field's view
        [groups, GROUP, nblocks, ...] (padding rows included)."""
        field = packed[..., start:start + GROUP * field_bytes].view(dtype)
        field = field.reshape(groups, nblocks, GROUP, -1).transpose(0, 2, 1, 3)
        whole, rest = divmod(rows, GROUP)
        field[:whole] = values[:whole * GROUP].reshape(whole, GROUP, nblocks, values.shape[-1])
        if rest:
            field[whole, :rest] = values[whole * GROUP:]
        return field

    d = blocks[..., 0:2].view(np.float16)
    place(0, 4, np.float32, d)
    if format == "Q4_1":
        place(4 * GROUP, 4, np.float32, blocks[..., 2:4].view(np.float16))
    elif format == "Q4_0":
        minimum = place(4 * GROUP, 4, np.float32, d)
        minimum *= -8  # the padding rows' too: -0.0, -8 times their zero scale
    place(4 * scales * GROUP, quants.shape[-1], np.uint8, quants)
    return torch.from_numpy(packed.reshape(-1))


def round_per_block(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x [..., K] rounded per block of 32 exactly as the integer kernels round it (LEVELS), back in
    float32: s * round-half-even(x * (levels / max|x_b|)) with s = max|x_b| / levels (the same
    float32 operations; an all-zero block stays zero, a block holding NaN becomes NaN)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # torch.full_like(...) / amax, not levels / amax: torch computes a scalar over a tensor as
    # reciprocal(amax) * levels, two roundings, which moves an element at a rounding tie one level.
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / levels)).reshape(x.shape)


class QuantizedLinear(nn.Module):
    """out = x @ W^T (+ bias) with W [out_features, in_features] held only as `packed` GGUF blocks
    (pack_blocks); forward picks by the number of rows. `activations` picks the kernel for the rows
    the blocks serve (see the module docstring); `max_rows` None: MAX_ROWS. Past them, `gemm`:
    tiles dequantised from the blocks and multiplied by torch's GEMM (tiled_gemm.py).
    `tp`: a row-parallel layer's group, whose ranks' partial outputs are summed (all-reduce);
    `sharded`: the blocks are this tensor-parallel rank's shard."""

    def __init__(self, packed: torch.Tensor, format: str, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, max_rows: int | None = None,
                 activations: str = DEFAULT_ACTIVATIONS, tp=None, sharded: bool = False):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        self.out_features, self.in_features = out_features, in_features
        expected = -(-out_features // GROUP) * in_features // 32 * PACKED_BYTES[format]
        if in_features % 32 or packed.numel() != expected:
            raise ValueError(f"{format} blocks of {packed.numel()} bytes do not fit a {out_features} x "
                             f"{in_features} weight; the GGUF file does not match the model")
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.ops = quantized_matmul_ops()
        self.q4_1 = format in NIBBLES
        self.activations = activations
        self.max_rows = MAX_ROWS[activations, self.ops.simd_lanes()] if max_rows is None else max_rows
        self.kernel = getattr(self.ops, KERNELS[activations])
        self.tp, self.sharded = tp, sharded or tp is not None

    def dequantize(self, row_start: int = 0, rows: int | None = None) -> torch.Tensor:
        """W[row_start:row_start + rows] (row_start a multiple of four) as float32 [rows, in_features]."""
        rows = self.out_features - row_start if rows is None else rows
        return self.ops.quantized_dequantize(self.packed, self.out_features, self.in_features, self.q4_1,
                                             row_start, rows)

    @property
    def weight(self) -> torch.Tensor:
        """W as float32 (a copy, for inspection and tests: the forward never builds it)."""
        return self.dequantize()

    def gemm(self, x: torch.Tensor, out_rows: int | None = None) -> torch.Tensor:
        """x [M, in_features] float32 @ W^T, tile by tile (no bias, no all-reduce); `out_rows`: only
        W's first rows (a multiple of four), for timing."""
        return tiled_gemm(x, out_rows or self.out_features, self.in_features, self.dequantize, align=GROUP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() == 2 and x.shape[0] <= self.max_rows and native_reads(x):
            out = self.kernel(x, self.packed, self.out_features, self.q4_1)
        else:
            x = x.reshape(-1, self.in_features).float().contiguous()
            out = self.gemm(round_per_block(x, LEVELS[self.activations]) if self.activations in LEVELS else x)
        if self.tp is not None:  # this rank's columns: sum over the ranks
            out = self.tp.all_reduce(out)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.reshape(*shape[:-1], self.out_features)


def use_quantized_linears(model: nn.Module, blocks: Iterable[tuple[str, str, np.ndarray]],
                          max_rows: int | None = None, activations: str = DEFAULT_ACTIVATIONS,
                          measure: bool = True) -> set[str]:
    """Replace `model`'s linear layers whose GGUF weights are Q4_0 / Q4_1 / Q8_0 by QuantizedLinears
    (before or after their weights load: a bias is kept as the module holds it, loaded later
    where still on the meta device). `blocks`: (Hugging Face weight name, GGUF type name, raw blocks
    [N, ...] with rows in the Hugging Face order); `max_rows` None: measured on this CPU
    (measure_max_rows, where `measure`; at most MAX_ROWS); `activations`: QuantizedLinear's. Fused
    projections (q/k/v, gate/up) get their parts' rows concatenated, when all parts share one
    format. A tied input embedding in one of these formats becomes a GGUFBlockEmbedding over the
    file's blocks plus the model's `quantized_lm_head`. Returns the weight names now held as
    blocks (not to be loaded); empty when the kernel cannot run here."""
    from blockserve.models.gguf_block_linear import GGUFBlockEmbedding, as_tensor, block_ops

    ops = quantized_matmul_ops()
    if ops is None or not ops.simd_lanes():
        logger.info("GGUF blocks not used: %s", "no native kernels" if ops is None
                    else "the quantized kernel needs AVX-512 or AVX2 (float32 weights are used)")
        return set()
    modules = dict(model.named_modules())
    parts: dict[str, dict[int, tuple[str, str, np.ndarray]]] = {}
    taken: set[str] = set()
    for name, format, raw in blocks:
        module_path = name.removesuffix(".weight")
        parent, _, proj = module_path.rpartition(".")
        names = [name]
        if proj in FUSED:
            fused, index, count = FUSED[proj]
            module_path = f"{parent}.{fused}"
            received = parts.setdefault(module_path, {})
            received[index] = (name, format, raw)
            if len(received) < count:
                continue
            formats = {f for _, f, _ in received.values()}
            if len(formats) > 1:  # e.g. v_proj in Q8_0 next to q/k in Q4_0: one kernel call cannot mix
                continue
            names = [received[i][0] for i in range(count)]
            format, raw = formats.pop(), np.concatenate([received[i][2] for i in range(count)])
        if format not in FORMATS:
            continue
        module = modules.get(module_path)
        if module_path == "model.embed_tokens" and getattr(model, "tie_word_embeddings", False):
            if type(module) is not nn.Embedding or block_ops() is None:  # the vocab-parallel one: its ranks' gather
                continue
            embedding = GGUFBlockEmbedding(format, as_tensor(raw), module.embedding_dim, name)
            setattr(modules[parent] if parent else model, "embed_tokens", embedding)
            model.quantized_lm_head = QuantizedLinear(pack_blocks(raw, format), format, raw.shape[0],
                                                      module.embedding_dim, None, max_rows, activations)
            taken.add(name)
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):  # this rank's blocks only
            raw = module.narrow_blocks(raw, FORMATS[format])
        if not isinstance(module, nn.Linear) or module.out_features != raw.shape[0]:
            continue
        sharded = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        setattr(modules[parent] if parent else model, module_path.rpartition(".")[2],
                QuantizedLinear(pack_blocks(raw, format), format, module.out_features, module.in_features,
                                module.bias, max_rows, activations,
                                tp=module.tp if isinstance(module, RowParallelLinear) else None, sharded=sharded))
        taken.update(names)
    if max_rows is None and measure:
        measure_max_rows(model)
    return taken


def measure_max_rows(model: nn.Module, cache: Path | None = None) -> None:
    """Each QuantizedLinear's max_rows set to where the float32 GEMM (over tiles dequantised from the blocks) starts to beat the blocks kernel clearly on
    this CPU (models/row_crossover.py), at most its kernel's MAX_ROWS. Not where they serve every row
    count (int8), and not under tensor parallelism (the GEMM's all-reduce is a collective: ranks
    timing it on their own would wait on each other): there the build's MAX_ROWS stands. `cache`:
    the cache root the measurement is stored under per machine (None: cached_directory.cache_root())."""
    linears = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    if not linears or linears[0].max_rows == EVERY_ROW or any(linear.sharded for linear in linears):
        return
    rows = crossover_rows(linears, linears[0].max_rows, cache=cache)
    for linear in linears:
        linear.max_rows = rows[shape_of(linear)]
