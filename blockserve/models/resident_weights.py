"""What a loaded model's weights hold in memory, by storage format, for the capacity report."""

from __future__ import annotations

from torch import nn

from blockserve.models.gguf_block_linear import GGUFBlockEmbedding, GGUFBlockLinear
from blockserve.models.quantized_linear import QuantizedLinear


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes per format, each storage counted once: GGUF blocks by their GGUF format (those read in
    place from the mapped file included), quantized_linear's packed copies as "Q4_0/Q4_1 packed" /
    "Q8_0 packed", every other parameter by its dtype."""
    owners: dict[int, tuple[str, int]] = {}

    def add(tensor, label: str) -> None:
        storage = tensor.untyped_storage()
        owners.setdefault(storage.data_ptr(), (label, storage.nbytes()))

    for module in model.modules():
        if isinstance(module, GGUFBlockLinear):
            for segment in module.segments:
                add(segment.raw, segment.format)
        elif isinstance(module, GGUFBlockEmbedding):
            add(module.segment.raw, module.segment.format)
        elif isinstance(module, QuantizedLinear):
            add(module.packed, "Q4_0/Q4_1 packed" if module.q4_1 else "Q8_0 packed")
    for parameter in model.parameters():
        add(parameter, str(parameter.dtype).removeprefix("torch."))
    totals: dict[str, int] = {}
    for label, nbytes in owners.values():
        totals[label] = totals.get(label, 0) + nbytes
    return totals


def resident_weight_report(model: nn.Module) -> str:
    """One line: the total MiB and each format's, largest first."""
    totals = resident_weight_bytes(model)
    parts = ", ".join(f"{label} {nbytes / 2**20:.1f}" for label, nbytes in sorted(totals.items(), key=lambda t: -t[1]))
    return f"{sum(totals.values()) / 2**20:.1f} MiB ({parts})"
