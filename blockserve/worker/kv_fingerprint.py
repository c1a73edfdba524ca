"""The fingerprint a second prefix-cache tier keys its entries by (kv/tiers/entry.py).

It names everything that decides a block's bytes: the weights' content, the model's dtype, the KV
groups (specs with their block size and KV dtype, and the layers in each), the quantized matmul's
activations and the tensor-parallel rank and size. Entries written under another fingerprint are
never read, so a different model, format, setting or tensor-parallel size starts cold. Under tensor
parallelism each rank fingerprints its own shard.
"""

from __future__ import annotations

import hashlib

import torch

FINGERPRINT_VERSION = b"blockserve-kv-offload-1"


def weights_digest(model: torch.nn.Module) -> bytes:
    """sha256 over every tensor of the model's state dict: name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            data = tensor.detach().contiguous().cpu()
            if data.numel():
                digest.update(data.view(-1).view(torch.uint8).numpy())
    return digest.digest()


def model_fingerprint(model: torch.nn.Module, config, kv_config, dtype: torch.dtype, rank: int = 0,
                      world_size: int = 1) -> bytes:
    """The fingerprint of `model` (this rank's shard) with `kv_config`'s groups, in `dtype`; `config`: the
    engine's settings (its quantized_matmul and quantized_activations are part of it)."""
    layout = repr([(g.spec, g.layer_names) for g in kv_config.groups])
    quantized = f"{config.quantized_matmul}|{config.quantized_activations}"
    parts = (FINGERPRINT_VERSION, weights_digest(model), str(dtype).encode(), layout.encode(), quantized.encode(),
             f"rank {rank} of {world_size}".encode())
    return hashlib.sha256(b"\0".join(parts)).digest()
