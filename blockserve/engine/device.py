"""Where the engine runs, resolved once at start-up: the device and the model dtype.

    device  auto -> cuda when torch.cuda.is_available(), else cpu;  cpu;  cuda;  cuda:N
    dtype   auto -> float32 on CPU, bfloat16 on CUDA;  float32;  bfloat16;  float16
            on the CPU, auto also keeps a checkpoint's 16-bit linear and embedding weights in 16 bits
            (float32 activations, models/half_linear.py); float32 widens every weight as it loads

`resolve_device_plan` turns EngineConfig's names into a frozen `DevicePlan` (errors a user can
act on: CUDA asked for where there is none, an index past the device count, a GPU memory share
on the CPU); the engine passes its `placement` down to the model and its `device` to the worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from blockserve.models.placement import Placement

DEVICES = ("auto", "cpu", "cuda")  # and cuda:N
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> None:
    """ValueError unless `name` is auto, cpu, cuda or cuda:N (torch-free callers: config checks)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class DevicePlan:
    """The resolved device and model dtype; `gpu_memory_utilization` only on CUDA (None on CPU);
    `keep_16bit_weights`: Placement's (dtype auto on the CPU)."""

    device: torch.device
    dtype: torch.dtype
    gpu_memory_utilization: float | None = None
    keep_16bit_weights: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def placement(self) -> Placement:
        return Placement(device=self.device, dtype=self.dtype, keep_16bit_weights=self.keep_16bit_weights)


def resolve_device(name: str, cuda_available: bool | None = None, cuda_count: int | None = None) -> torch.device:
    """The torch device `name` means here. `cuda_available` / `cuda_count`: what torch.cuda says
    (given by tests)."""
    check_device_name(name)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda", 0) if cuda_available else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not cuda_available:
        raise ValueError(f"device={name!r} but CUDA is not available here (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); use device='cpu' (--device cpu) or 'auto'")
    index = int(name.partition(":")[2] or 0)
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if index >= count:
        raise ValueError(f"device={name!r} but this machine has {count} CUDA device(s): choose cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The model dtype `name` means on `device` (auto: float32 on CPU, bfloat16 on CUDA)."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {list(DTYPES)}")
    return DTYPES[name]


def resolve_device_plan(device: str, dtype: str, gpu_memory_utilization: float | None,
                        cuda_available: bool | None = None, cuda_count: int | None = None) -> DevicePlan:
    """EngineConfig's device, dtype and gpu_memory_utilization (None: 0.9 on CUDA), resolved (see
    the module docstring)."""
    resolved = resolve_device(device, cuda_available, cuda_count)
    if gpu_memory_utilization is not None and resolved.type != "cuda":
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} applies to CUDA only, but the engine runs "
                         f"on {resolved} (device={device!r}); on the CPU size the KV cache with kv_cache_memory "
                         "(--kv-cache-memory)")
    if resolved.type == "cuda" and gpu_memory_utilization is None:
        gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    return DevicePlan(resolved, resolve_dtype(dtype, resolved), gpu_memory_utilization,
                      keep_16bit_weights=dtype == "auto" and resolved.type == "cpu")
