"""The KV cache's memory: one tensor per group (per state component for state groups),
holding all the group's layers, so a zero order is one indexed fill per tensor.

    attention group  [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_size]
                     (quantized: rows of codes + their float16 scale, attention/kv_quant.py);
                     K and V in different dtypes (spec.v_dtype): two tensors, K's then V's,
                     [layers, num_blocks, block_size, kv_heads, row] each
    MLA group        [layers, num_blocks, block_size, kv_lora_rank + rope_dim]
                     (quantized: codes, then the two parts' float16 scales, attention/latent_quant.py)
    state group      one tensor per state component: [layers, num_slots, *shape], the running
                     slots followed by the checkpoint slots

Block (slot) 0 is the null block: zero from the start, never zeroed, poisoned or written.
Past the pool's slots each tensor holds one scratch slot (index `num_slots`), which the pool never
hands out: padded rows of a captured decode step (worker/cuda_graphs.py) write there.

On the CPU each tensor is a private anonymous mapping (`zeros`): the OS's zero pages, so the cache
reads as zeros from the start without being written, and a page takes memory only once a block on
it is written (the process's resident size grows with the blocks used, not the budget).
"""

from __future__ import annotations

import math
import mmap

import torch

from blockserve.attention import kv_quant, latent_quant
from blockserve.attention.context import LayerCache, MLACache, StateCache
from blockserve.attention.metadata import to_device
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.specs import LinearStateSpec, MLASpec, kv_row_bytes

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int4_rotated": torch.uint8,  # packed codes and their float16 scale and minimum (attention/kv_quant.py)
}


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on the CPU backed by a private anonymous
    mapping, which reads as zeros with nothing written (torch.zeros writes every byte, so the whole
    cache would be resident from the start). The tensor holds the mapping; it is unmapped with
    the tensor's storage."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def _row(dtype: str, head_size: int) -> int:
    """Elements of one stored head vector (bytes for the quantized forms, scales included)."""
    return kv_row_bytes(dtype, head_size) // TORCH_DTYPES[dtype].itemsize


class KVCacheTensors:
    def __init__(self, config: KVCacheConfig, *, device: torch.device | str):
        self.config = config
        self.tensors: list[list[torch.Tensor]] = []  # per group, its tensors
        self.block_dims: list[int] = []  # per group, the dimension indexed by block id
        for group in config.groups:
            spec, layers, n = group.spec, max(1, len(group.layer_names)), group.num_slots + 1  # + scratch
            if isinstance(spec, LinearStateSpec):
                tensors = [zeros(layers, n, *s, dtype=TORCH_DTYPES[d], device=device)
                           for s, d in zip(spec.shapes, spec.dtypes)]
                block_dim = 1
            elif isinstance(spec, MLASpec):
                width = spec.row_bytes // TORCH_DTYPES[spec.dtype].itemsize
                tensors = [zeros(layers, n, spec.block_size, width, dtype=TORCH_DTYPES[spec.dtype], device=device)]
                block_dim = 1
            elif spec.v_dtype is not None:
                tensors = [zeros(layers, n, spec.block_size, spec.num_kv_heads, _row(d, spec.head_size),
                                       dtype=TORCH_DTYPES[d], device=device) for d in (spec.dtype, spec.v_dtype)]
                block_dim = 1
            else:
                shape = (layers, 2, n, spec.block_size, spec.num_kv_heads, _row(spec.dtype, spec.head_size))
                tensors = [zeros(*shape, dtype=TORCH_DTYPES[spec.dtype], device=device)]
                block_dim = 2
            self.tensors.append(tensors)
            self.block_dims.append(block_dim)
        if config.poison_freed_blocks:  # every block starts as garbage, as after a long uptime
            for group_id, group in enumerate(config.groups):
                self.poison_blocks(group_id, range(1, group.num_slots))

    def scratch_slot(self, group_id: int) -> int:
        """The group's scratch block (slot): written only by padding, read only by padding."""
        return self.config.groups[group_id].num_slots

    def zero_blocks(self, group_id: int, block_ids) -> None:
        """C1: zero the given blocks of every layer of the group, one indexed fill per tensor
        (codes and scales of a quantized one)."""
        self._fill(group_id, block_ids, poison=False)

    def poison_blocks(self, group_id: int, block_ids) -> None:
        """Poison mode: fill the given blocks with NaN (a quantized cache: codes -128 and NaN
        scales) so that any read of them shows."""
        self._fill(group_id, block_ids, poison=True)

    def copy_slots(self, group_id: int, pairs) -> None:
        """State groups: copy slot `src` into slot `dst` in every layer, for each (src, dst)."""
        if not pairs:
            return
        src, dst = zip(*pairs)
        if 0 in dst:
            raise ValueError(f"group {group_id}: the null slot must never be written")
        device = self.tensors[group_id][0].device
        src, dst = to_device((torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)), device)
        for tensor in self.tensors[group_id]:
            tensor[:, dst] = tensor[:, src]

    def block_bytes(self, group_id: int, block_id: int) -> memoryview:
        """The block's content in every layer of the group, copied once into host memory (a second
        tier's payload, bytes-like)."""
        dim = self.block_dims[group_id]
        out = torch.empty(self.block_nbytes(group_id), dtype=torch.uint8)
        offset = 0
        for tensor in self.tensors[group_id]:
            src = tensor.select(dim, block_id)
            size = src.numel() * src.element_size()
            out[offset : offset + size].view(src.dtype).view(src.shape).copy_(src)
            offset += size
        return memoryview(out.numpy())

    def block_nbytes(self, group_id: int) -> int:
        """The length of `block_bytes(group_id, ...)`."""
        dim = self.block_dims[group_id]
        return sum(t.select(dim, 0).numel() * t.element_size() for t in self.tensors[group_id])

    def load_blocks(self, group_id: int, loads) -> None:
        """Write each (block, payload) of `loads`: the inverse of `block_bytes`. A payload of the wrong
        size is a ValueError (the tier's key names the KV format, so it means a bug). Off the CPU the
        payloads go to the device in one copy from one staging buffer (pinned under CUDA, so the copy
        does not wait for the host), then into each block's place."""
        loads = list(loads)
        if not loads:
            return
        if any(block_id == 0 for block_id, _ in loads):
            raise ValueError(f"group {group_id}: the null block must never be written")
        nbytes = self.block_nbytes(group_id)
        for _, payload in loads:
            if len(payload) != nbytes:
                raise ValueError(f"group {group_id}: a loaded block has {len(payload)} bytes, its layout {nbytes}")
        tensors, dim = self.tensors[group_id], self.block_dims[group_id]
        device = tensors[0].device
        rows = [torch.frombuffer(payload, dtype=torch.uint8) for _, payload in loads]
        if device.type != "cpu":
            staging = torch.empty(len(loads), nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            for row, data in zip(staging, rows):
                row.copy_(data)
            rows = staging.to(device, non_blocking=True)
        for row, (block_id, _) in zip(rows, loads):
            offset = 0
            for tensor in tensors:
                dst = tensor.select(dim, block_id)
                size = dst.numel() * dst.element_size()
                dst.copy_(row[offset : offset + size].view(dst.dtype).view(dst.shape))
                offset += size

    def _fill(self, group_id: int, block_ids, poison: bool) -> None:
        block_ids = list(block_ids)
        if not block_ids:
            return
        if 0 in block_ids:
            raise ValueError(f"group {group_id}: the null block must never be zeroed or poisoned")
        tensors = self.tensors[group_id]
        index = to_device(torch.tensor(block_ids, dtype=torch.int64), tensors[0].device)
        fill = latent_quant.fill_rows if isinstance(self.config.groups[group_id].spec, MLASpec) else kv_quant.fill_rows
        for tensor in tensors:
            fill(tensor, self.block_dims[group_id], index, poison)

    def layer_caches(self) -> dict[str, LayerCache | MLACache | StateCache]:
        """Each layer's views of its group's tensors, by layer name."""
        caches = {}
        for group_id, group in enumerate(self.config.groups):
            tensors = self.tensors[group_id]
            for i, name in enumerate(group.layer_names):
                if group.is_state:
                    caches[name] = StateCache(group_id, [t[i] for t in tensors])
                elif isinstance(group.spec, MLASpec):
                    caches[name] = MLACache(group_id, tensors[0][i])
                elif len(tensors) == 2:  # K and V in their own dtypes
                    caches[name] = LayerCache(group_id, tensors[0][i], tensors[1][i])
                else:
                    caches[name] = LayerCache(group_id, tensors[0][i, 0], tensors[0][i, 1])
        return caches

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.tensors for t in tensors)
