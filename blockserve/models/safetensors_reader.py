"""A safetensors file's tensors read one at a time into memory of their own (not mapped from the file).

safetensors' own `safe_open` maps the file and hands out tensors over the mapping, so every page a
load touches stays resident as long as any tensor of the file lives: the pieces of a fused weight
(q, k, v; gate, up), a tensor-parallel rank's whole tensor of which it keeps a shard, and the 16-bit
original of a weight widened to float32 would each be held twice. Reading each tensor into its own
buffer keeps only what the model keeps, plus the one tensor in flight.

    file:  [header length: 8 bytes, little-endian][header: JSON][data]
    header {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, ...,
            "__metadata__": {...}}        (offsets into data)

ValueError for a header or tensor the file cannot hold (a truncated download, say).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 << 20  # the format's own limit


def read_tensors(path: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of the safetensors file `path` whose name `keep` takes (None:
    all), in file order, each in a fresh CPU tensor (the others are not read). ValueError naming
    the file and what is wrong with it."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        header, data_start = _header(file, size, path)
        entries = sorted(((name, entry) for name, entry in header.items() if name != "__metadata__"),
                         key=lambda item: _offsets(item[1], item[0], path)[0])
        for name, entry in entries:
            begin, end = _offsets(entry, name, path)
            dtype = DTYPES.get(entry.get("dtype"))
            shape = entry.get("shape")
            if dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r} and shape {shape!r}, "
                                 f"which blockserve cannot read (dtypes: {', '.join(DTYPES)})")
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if end - begin != nbytes or data_start + end > size:
                raise ValueError(f"{path}: tensor {name!r} ({entry['dtype']} {shape}) should take {nbytes} bytes at "
                                 f"[{begin}, {end}) of the data, but the file has {size - data_start}: truncated "
                                 "or corrupt")
            if keep is not None and not keep(name):
                continue
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            file.seek(data_start + begin)
            if nbytes and file.readinto(memoryview(buffer.numpy())) != nbytes:
                raise ValueError(f"{path}: tensor {name!r} was cut short: truncated")
            yield name, buffer.view(dtype).reshape(shape)


def _header(file, size: int, path: Path) -> tuple[dict, int]:
    length_bytes = file.read(8)
    length = int.from_bytes(length_bytes, "little") if len(length_bytes) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{path}: not a safetensors file (header length {length} in a file of {size} bytes)")
    try:
        header = json.loads(file.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: the safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + length


def _offsets(entry, name: str, path: Path) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets in the safetensors header")
    return offsets[0], offsets[1]
