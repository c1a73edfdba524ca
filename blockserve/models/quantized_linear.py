"""Linear layers that keep the GGUF blocks their float32 weights were dequantised from.

A GGUF model is served from float32 weights (models/loader.py): 4 bytes per weight. The file's
Q4_0 / Q4_1 and Q8_0 blocks encode the same values in 0.75 and 1.125 bytes per weight (as packed
here), and a small-batch decode step is bound by reading weights, so the native kernels
(native/csrc/quantized_matmul.cpp) read the blocks instead. `activations` picks one of three:

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
              rows >  max_rows   the float32 layer it wraps (nn.Linear; PanelLinear when it has at
                                 least PANEL_MIN_OUT outputs: faster above 16 rows)
    int8:     every row count    the int8 kernel (row tiles of 128 inside it); the float32 layer on x
                                 rounded as the kernel rounds it (`round_per_block`) only where the
                                 kernel cannot run (no native build, x not a 2-D float32 CPU tensor)
    int16:    rows <= max_rows   the int16 kernel (float32's max_rows)
              rows >  max_rows   the float32 layer on x rounded as the kernel rounds it (also where
                                 the kernel cannot run)

Under "int8", and "int16" up to max_rows, a matmul row's result is the same bits whatever shares its
call (each output is the same integer block dots summed in the same order); under "float32", and
"int16" past max_rows, the same up to float rounding (~1e-6): the blocks and the GEMM sum in
different orders.

The kernel reads Q4_1 (w = d * q + m), Q4_0 (w = d * (q - 8), packed as Q4_1 with m = -8 d)
and Q8_0 (w = d * q), d and m float16; the other block formats run from the file's own blocks
(gguf_block_linear.py). The blocks cost memory on top of the float32 copy.

Tensor-parallel: each rank keeps the blocks of its own shard (`narrow_blocks` of the column- and
row-parallel layers, tensor_parallel/layers.py); a row-parallel layer's partial product is
all-reduced, as its float32 layer's is. The tied LM head stays the vocab-parallel float32 one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from blockserve.native.extension import quantized_matmul_ops
from blockserve.native.gate import native_reads
from blockserve.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from blockserve.models.row_crossover import crossover_rows, shape_of
from blockserve.models.weight_layout import PANEL_MIN_OUT, PanelLinear
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
    four rows' quantized values. N is padded to a multiple of four with zero rows."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, FORMATS[format])
    padded = -rows % GROUP
    if padded:
        blocks = np.concatenate([blocks, np.zeros((padded, *blocks.shape[1:]), np.uint8)])
    groups, nblocks = blocks.shape[0] // GROUP, blocks.shape[1]

    def per_group(field: np.ndarray) -> np.ndarray:  # [N, nblocks, b] -> [groups, nblocks, GROUP * b]
        return field.reshape(groups, GROUP, nblocks, -1).transpose(0, 2, 1, 3).reshape(groups, nblocks, -1)

    def as_float32(half: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(half).view(np.float16).astype(np.float32).view(np.uint8)

    if format == "Q4_1":
        fields = [as_float32(blocks[..., 0:2]), as_float32(blocks[..., 2:4]), blocks[..., 4:]]
    elif format == "Q4_0":  # w = d * (q - 8): Q4_1 with m = -8 d (exact in float32)
        scale = as_float32(blocks[..., 0:2])
        fields = [scale, (-8 * scale.view(np.float32)).view(np.uint8), blocks[..., 2:]]
    else:
        fields = [as_float32(blocks[..., 0:2]), blocks[..., 2:]]
    packed = np.concatenate([per_group(field) for field in fields], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))


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


def sharing_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear over existing tensors (nothing allocated), e.g. over a tied embedding."""
    def shared(t: torch.Tensor | None) -> nn.Parameter | None:  # a Parameter over the same storage
        return t if t is None or isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight, linear.bias = shared(weight), shared(bias)
    return linear


class QuantizedLinear(nn.Module):
    """A float32 linear layer `dense` (nn.Linear or PanelLinear, weight [N, K]) plus the packed
    GGUF blocks of the same weight; forward picks by the number of rows. `activations` picks the
    kernel for the rows the blocks serve (see the module docstring);
    `max_rows` None: MAX_ROWS."""

    def __init__(self, dense: nn.Module, packed: torch.Tensor, format: str, max_rows: int | None = None,
                 activations: str = DEFAULT_ACTIVATIONS):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        self.out_features, self.in_features = dense.out_features, dense.in_features
        expected = -(-self.out_features // GROUP) * self.in_features // 32 * PACKED_BYTES[format]
        if self.in_features % 32 or packed.numel() != expected:
            raise ValueError(f"{format} blocks of {packed.numel()} bytes do not fit a {self.out_features} x "
                             f"{self.in_features} weight; the GGUF file does not match the model")
        self.dense = dense
        self.register_buffer("packed", packed, persistent=False)
        ops = quantized_matmul_ops()
        self.q4_1 = format in NIBBLES
        self.activations = activations
        self.max_rows = MAX_ROWS[activations, ops.simd_lanes()] if max_rows is None else max_rows
        self.kernel = getattr(ops, KERNELS[activations])

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > self.max_rows or not native_reads(x):
            return self.dense(round_per_block(x, LEVELS[self.activations]) if self.activations in LEVELS else x)
        out = self.kernel(x, self.packed, self.out_features, self.q4_1)
        if isinstance(self.dense, RowParallelLinear):  # this rank's columns: sum over the ranks
            out = self.dense.tp.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)


def use_quantized_linears(model: nn.Module, blocks: Iterable[tuple[str, str, np.ndarray]],
                          max_rows: int | None = None, activations: str = DEFAULT_ACTIVATIONS) -> int:
    """Give `model`'s linear layers their GGUF blocks: (Hugging Face weight name, GGUF type name,
    raw blocks [N, ...] with rows in the Hugging Face order); `max_rows` None: measured on this
    CPU (measure_max_rows; at most MAX_ROWS); `activations`: QuantizedLinear's. Fused
    projections (q/k/v, gate/up) get their parts' rows concatenated, when all parts share one format.
    A tied input embedding becomes the model's `quantized_lm_head`. Returns how many layers use blocks; 0 when the kernel cannot run here."""
    ops = quantized_matmul_ops()
    if ops is None or not ops.simd_lanes():
        logger.info("GGUF blocks not used for small batches: %s", "no native kernels" if ops is None
                    else "the quantized kernel needs AVX-512 or AVX2 (float32 weights are used)")
        return 0
    modules = dict(model.named_modules())
    parts: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    used = 0
    for name, format, raw in blocks:
        module_path = name.removesuffix(".weight")
        parent, _, proj = module_path.rpartition(".")
        if proj in FUSED:
            fused, index, count = FUSED[proj]
            module_path = f"{parent}.{fused}"
            received = parts.setdefault(module_path, {})
            received[index] = (format, raw)
            if len(received) < count:
                continue
            formats = {f for f, _ in received.values()}
            if len(formats) > 1:  # e.g. v_proj in Q8_0 next to q/k in Q4_0: one kernel call cannot mix
                continue
            format, raw = formats.pop(), np.concatenate([received[i][1] for i in range(len(received))])
        if format not in FORMATS:
            continue
        if module_path == "model.embed_tokens" and getattr(model, "tie_word_embeddings", False):
            if isinstance(modules[module_path], VocabParallelEmbedding):  # its logits: the ranks' gather
                continue
            embedding = modules[module_path]
            model.quantized_lm_head = QuantizedLinear(sharing_linear(embedding.weight), pack_blocks(raw, format),
                                                      format, max_rows, activations)
            used += 1
            continue
        linear = modules.get(module_path)
        if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):  # this rank's blocks only
            raw = linear.narrow_blocks(raw, FORMATS[format])
        if not isinstance(linear, (nn.Linear, PanelLinear)) or linear.out_features != raw.shape[0]:
            continue
        if type(linear) is nn.Linear and linear.out_features >= PANEL_MIN_OUT:
            linear = PanelLinear(linear.weight.detach(), linear.bias)
        parent_module = modules[parent] if parent else model
        setattr(parent_module, module_path.rpartition(".")[2],
                QuantizedLinear(linear, pack_blocks(raw, format), format, max_rows, activations))
        used += 1
    if max_rows is None:
        measure_max_rows(model)
    return used


def measure_max_rows(model: nn.Module) -> None:
    """Each QuantizedLinear's max_rows set to where the float32 GEMM starts to beat its blocks clearly on
    this CPU (models/row_crossover.py), at most its kernel's MAX_ROWS. Not where they serve every row
    count (int8), and not under tensor parallelism (the GEMM's all-reduce is a collective: ranks
    timing it on their own would wait on each other): there the build's MAX_ROWS stands."""
    linears = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    if (not linears or linears[0].max_rows == EVERY_ROW
            or any(isinstance(linear.dense, (ColumnParallelLinear, RowParallelLinear)) for linear in linears)):
        return
    rows = crossover_rows(linears, linears[0].max_rows)
    for linear in linears:
        linear.max_rows = rows[shape_of(linear)]
