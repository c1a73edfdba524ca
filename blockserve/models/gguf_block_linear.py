"""Linear layers and embeddings that keep a GGUF weight in the file's own blocks, with no float32
copy: the 5-bit formats, the K-quants and IQ4 (csrc/gguf_blocks.cpp reads them in place), and a
Q4_0 / Q4_1 / Q8_0 part where quantized_linear.py's packed layout does not take it (a fused
projection whose parts differ in format).

GGUFBlockLinear, out = x @ W^T (+ bias), W given as row segments (a fused projection's parts, each
in its own format):

    rows <= 8          gguf_matmul_limbs (gguf_matmul_decode): x taken exactly as four integer
                       limbs per block of 32 (csrc/block_limbs.h) and dotted with the blocks' levels
                       by the int8 kernel's integer dots: x @ W^T to float32 rounding
    rows <= MAX_ROWS   gguf_matmul: four output rows at a time dequantised in registers as they
                       are multiplied with the rows (past 8 rows, 2 on AVX2: into a small buffer,
                       then register tiles)
                       Both read the weights at their file size, and a row's sums do not depend on
                       the rows beside it within each range (a decode step's batch)
    more rows          tiles of dequantised weights (tiled_gemm.py), each multiplied by torch's
                       GEMM and dropped (prefill)

With int8 activations (--quantized-activations int8) every row count runs gguf_matmul_int8
(csrc/gguf_blocks_int8.cpp): x rounded per block of 32 to int8 levels as quantized_linear's integer
kernels round it, integer dots with the blocks' levels (every format above), so a row's result is the
same bits whatever shares its call. With int16, x is rounded the same way (32767 levels) and the
float paths above multiply it, so every layer of a model computes the same function.
GGUFBlockEmbedding looks rows up by dequantising just those rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from blockserve.models.quantized_linear import DEFAULT_ACTIVATIONS, FUSED, LEVELS, round_per_block
from blockserve.models.tiled_gemm import tiled_gemm
from blockserve.native.extension import quantized_matmul_ops
from blockserve.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


# The formats csrc/gguf_blocks.cpp reads; those first in this tuple (NEW_FORMATS) have no other kernel.
KERNEL_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                  "IQ4_XS")
NEW_FORMATS = KERNEL_FORMATS[3:]
# byte offsets of each block's float16 scales (d, and dmin / m where the format has them)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
                 "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
_FLOAT16_EXPONENT = 0x7C00  # a float16's exponent bits: all set in inf and NaN only
MAX_ROWS = 64  # up to it gguf_matmul is faster than the tiled GEMM on both builds (docs/cpu.md)


def block_shape(format: str) -> tuple[int, int]:
    """(values, bytes) per block of the GGUF `format`."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[format]]


def block_ops():
    """The native module when it can run gguf_blocks.cpp's kernels here, else None."""
    ops = quantized_matmul_ops()
    return ops if ops is not None and hasattr(ops, "gguf_matmul") else None


@dataclass(frozen=True)
class Segment:
    """`raw` [rows, row bytes] uint8: rows of a weight in GGUF `format`."""
    format: str
    raw: torch.Tensor


def _checked(format: str, raw: torch.Tensor, columns: int, what: str) -> Segment:
    if format not in KERNEL_FORMATS:
        raise ValueError(f"{what}: no block kernel for GGUF format {format} (read: {', '.join(KERNEL_FORMATS)})")
    values, nbytes = block_shape(format)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or columns % values or raw.shape[1] != columns // values * nbytes:
        raise ValueError(f"{what}: {format} blocks of shape {tuple(raw.shape)} do not hold rows of {columns} "
                         "values; the GGUF file does not match the model")
    return Segment(format, raw.contiguous())


class GGUFBlockLinear(nn.Module):
    """out = x @ W^T (+ bias) with W [out_features, in_features] the concatenation of `segments`'
    rows (see the module docstring). `tp`: a row-parallel layer's group, whose ranks' outputs are
    summed (all-reduce) before the bias."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None = None,
                 activations: str = DEFAULT_ACTIVATIONS, tp=None, what: str = "weight"):
        super().__init__()
        self.ops = block_ops()
        if self.ops is None:
            raise RuntimeError("GGUF block kernels need the native extension (AVX2 or AVX-512)")
        self.segments = [_checked(format, raw, in_features, what) for format, raw in segments]
        self.in_features = in_features
        self.out_features = sum(s.raw.shape[0] for s in self.segments)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.levels = LEVELS.get(activations)
        self.activations = activations
        self.integer_kernel = activations == "int8"  # False: round x, then the float paths (for comparisons)
        self.tp = tp
        for i, segment in enumerate(self.segments):  # buffers: moved and counted with the module
            self.register_buffer(f"blocks_{i}", segment.raw, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).float().contiguous()
        if self.integer_kernel:
            outs = [self.ops.gguf_matmul_int8(x, s.raw, s.format) for s in self.segments]
        else:
            if self.levels is not None:
                x = round_per_block(x, self.levels)
            outs = [self._segment(x, s) for s in self.segments]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def _segment(self, x: torch.Tensor, segment: Segment) -> torch.Tensor:
        if x.shape[0] <= MAX_ROWS:
            return self.ops.gguf_matmul_decode(x, segment.raw, segment.format)
        return tiled_gemm(x, segment.raw.shape[0], self.in_features,
                          lambda start, count: self.ops.gguf_dequantize(segment.raw[start:start + count],
                                                                        segment.format, self.in_features))

    def resident_bytes(self) -> int:
        return sum(s.raw.numel() for s in self.segments)


class GGUFBlockEmbedding(nn.Module):
    """An embedding table [num_embeddings, embedding_dim] kept in GGUF `format`; looking ids up
    dequantises their rows only."""

    def __init__(self, format: str, raw: torch.Tensor, embedding_dim: int, what: str = "embedding"):
        super().__init__()
        self.ops = block_ops()
        if self.ops is None:
            raise RuntimeError("GGUF block kernels need the native extension (AVX2 or AVX-512)")
        self.segment = _checked(format, raw, embedding_dim, what)
        self.num_embeddings, self.embedding_dim = raw.shape[0], embedding_dim
        self.register_buffer("blocks", self.segment.raw, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.segment.raw.index_select(0, ids.reshape(-1))
        return self.ops.gguf_dequantize(rows, self.segment.format, self.embedding_dim).reshape(*ids.shape, -1)

    def resident_bytes(self) -> int:
        return self.segment.raw.numel()


def check_blocks(name: str, format: str, raw: np.ndarray, rows: int, columns: int) -> None:
    """ValueError naming the tensor unless `raw` holds `rows` x `columns` values of `format` with
    finite scales (a truncated or corrupt file)."""
    values, nbytes = block_shape(format)
    if columns % values or raw.size != rows * columns // values * nbytes:
        raise ValueError(f"GGUF tensor {name}: {raw.size} bytes of {format} blocks for a {rows} x {columns} "
                         "weight; the file is corrupt or truncated: download it again")
    # one strided pass over each block's scale bytes (a format's scales sit side by side), read as the
    # float16 bits: a scale is inf or NaN where its exponent bits are all ones
    offsets = SCALE_OFFSETS[format]
    scale_bits = np.asarray(raw).reshape(-1, nbytes)[:, offsets[0]:offsets[-1] + 2].view("<u2")
    if ((scale_bits & _FLOAT16_EXPONENT) == _FLOAT16_EXPONENT).any():
        raise ValueError(f"GGUF tensor {name}: {format} blocks with non-finite scales; the file is corrupt: "
                         "download it again")


def as_tensor(raw: np.ndarray) -> torch.Tensor:
    """GGUF blocks [rows, bytes] (a numpy view, possibly of the read-only mapped file: used in
    place, never written) as a uint8 tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))


def use_block_modules(model: nn.Module, blocks: Iterable[tuple[str, str, np.ndarray]],
                      activations: str = DEFAULT_ACTIVATIONS) -> set[str]:
    """Replace `model`'s linear layers (and its embedding, with a tied head) whose GGUF weights
    csrc/gguf_blocks.cpp reads by GGUFBlockLinear / GGUFBlockEmbedding, before its weights load:
    `blocks` is (Hugging Face weight name, GGUF format, raw blocks [rows, bytes], rows in Hugging
    Face order) for every weight in a KERNEL_FORMATS format. A layer whose parts all share one of
    quantized_linear.py's formats is left to it. Tensor parallel: a column-parallel layer keeps its
    rows, a row-parallel one its columns, which must be whole blocks (shard_blocks: ValueError with
    the way out otherwise); the vocab-parallel embedding and head stay float32. Returns the weight
    names now held as blocks (not to be loaded)."""
    modules = dict(model.named_modules())
    pending: dict[str, dict[int, tuple[str, str, np.ndarray]]] = {}
    taken: set[str] = set()
    for name, format, raw in blocks:
        if not name.endswith(".weight"):
            continue
        path = name.removesuffix(".weight")
        parent, _, proj = path.rpartition(".")
        parts = [(name, format, raw)]
        if proj in FUSED:
            fused, index, count = FUSED[proj]
            path = f"{parent}.{fused}"
            received = pending.setdefault(path, {})
            received[index] = (name, format, raw)
            if len(received) < count:
                continue
            parts = [received[i] for i in range(count)]
        formats = {f for _, f, _ in parts}
        if len(formats) == 1 and formats.pop() not in NEW_FORMATS:
            continue  # quantized_linear.py's packed kernels take it
        module = modules.get(path)
        if path == "model.embed_tokens" and type(module) is nn.Embedding:
            embedding = GGUFBlockEmbedding(format, as_tensor(raw), module.embedding_dim, name)
            _replace(model, path, embedding)
            if getattr(model, "tie_word_embeddings", False):
                model.quantized_lm_head = GGUFBlockLinear([(format, embedding.segment.raw)], module.embedding_dim,
                                                          activations=activations, what=name)
            taken.add(name)
            continue
        if not isinstance(module, nn.Linear):
            continue
        segments = _this_ranks_segments(module, parts)
        linear = GGUFBlockLinear(segments, module.in_features, module.bias, activations, what=name,  # the bias
                                 tp=module.tp if isinstance(module, RowParallelLinear) else None)  # loads later
        _replace(model, path, linear)
        taken.update(n for n, _, _ in parts)
    return taken


def _this_ranks_segments(module: nn.Linear, parts: list[tuple[str, str, np.ndarray]]):
    """(format, blocks) per part of `module`'s weight as this rank holds it (shard_blocks' ValueError
    where a row-parallel rank's columns do not fall on whole blocks)."""
    if isinstance(module, ColumnParallelLinear):
        return [(f, as_tensor(raw[s.start:s.start + s.size])) for (_, f, raw), s in zip(parts, module.slices)]
    if isinstance(module, RowParallelLinear):
        return [(format, as_tensor(shard_blocks(raw, format, module.in_slice, module.tp.size, name)))
                for name, format, raw in parts]
    return [(f, as_tensor(raw)) for _, f, raw in parts]


def shard_blocks(raw: np.ndarray, format: str, columns, tp_size: int, what: str) -> np.ndarray:
    """This rank's `columns` (a Slice of each row's columns.full values) of GGUF blocks raw
    [..., rows, row bytes]: whole blocks, a view of them. ValueError with the way out where the
    rank's share starts or ends inside a block (256 values for the K-quants, 32 for the others)."""
    values, nbytes = block_shape(format)
    start, size = columns.start, columns.size
    if raw.shape[-1] != columns.full // values * nbytes or columns.full % values:
        raise ValueError(f"{what}: {format} rows of {raw.shape[-1]} bytes do not hold {columns.full} values; "
                         "the GGUF file does not match the model")
    if start % values or size % values:
        raise ValueError(f"{what}: {columns.full} columns over {tp_size} ranks are {size} per rank, not whole "
                         f"{values}-wide {format} GGUF blocks: serve it with --no-quantized-matmul (float32), or "
                         f"with a --tensor-parallel-size that leaves each rank a multiple of {values} columns")
    blocks = raw.reshape(*raw.shape[:-1], -1, nbytes)[..., start // values:(start + size) // values, :]
    return blocks.reshape(*raw.shape[:-1], -1)


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def block_resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of GGUF blocks `model`'s block modules (experts included) hold, per format (shared
    blocks counted once)."""
    seen: dict[int, tuple[str, int]] = {}
    for module in model.modules():
        segments = (module.segments if isinstance(module, GGUFBlockLinear) else
                    [module.segment] if isinstance(module, GGUFBlockEmbedding) else
                    getattr(module, "block_segments", []))  # gguf_block_experts.GGUFBlockExperts
        for segment in segments:
            seen[segment.raw.data_ptr()] = (segment.format, segment.raw.numel())
    totals: dict[str, int] = {}
    for format, nbytes in seen.values():
        totals[format] = totals.get(format, 0) + nbytes
    return totals
