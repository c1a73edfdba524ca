"""What a loaded model's weights hold in memory, for the engine's start-up report.

    weights resident: 0.94 GiB bfloat16, 0.01 GiB float32 (1.0 GiB in all); peak RSS by the end of loading 1.2 GiB

Bytes are counted from the tensors' storages (each once: a tied head shares the embedding's), per
dtype or, for GGUF blocks, per format. The peak RSS is the process's high-water
mark (VmHWM) when the report is made, which in a fresh process is the load's peak.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from blockserve.models.gguf_block_experts import GGUFBlockExperts
from blockserve.models.gguf_block_linear import GGUFBlockEmbedding, GGUFBlockLinear
from blockserve.models.quantized_linear import QuantizedLinear

GIB = 2 ** 30


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the model's weights, each storage counted once: GGUF blocks by their GGUF format
    (those read in place from the mapped file included), quantized_linear's packed copies as
    "Q4_0/Q4_1 packed" / "Q8_0 packed", every other parameter and buffer by its dtype name
    ("bfloat16", "float32", ...); tensors on the meta device hold none."""
    held: dict[str, int] = {}
    seen: set[int] = set()

    def add(tensor, label: str) -> None:
        storage = tensor.untyped_storage()
        if tensor.device.type == "meta" or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        held[label] = held.get(label, 0) + storage.nbytes()

    for module in model.modules():
        if isinstance(module, (GGUFBlockLinear, GGUFBlockExperts)):
            for segment in module.segments if isinstance(module, GGUFBlockLinear) else module.block_segments:
                add(segment.raw, segment.format)
        elif isinstance(module, GGUFBlockEmbedding):
            add(module.segment.raw, module.segment.format)
        elif isinstance(module, QuantizedLinear):
            add(module.packed, "Q4_0/Q4_1 packed" if module.q4_1 else "Q8_0 packed")
    for tensor in (*model.parameters(), *model.buffers()):
        add(tensor, str(tensor.dtype).removeprefix("torch."))
    return held


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (VmHWM), or None where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if line is None else int(line.split()[1]) * 1024


def weight_memory_report(model: nn.Module) -> str:
    """One line: the weights' resident GiB per dtype (largest first), their total, and the peak RSS."""
    held = sorted(resident_weight_bytes(model).items(), key=lambda item: -item[1])
    parts = ", ".join(f"{size / GIB:.3f} GiB {name}"
                      for name, size in held)
    peak = peak_rss_bytes()
    return (f"weights resident: {parts} ({sum(size for _, size in held) / GIB:.3f} GiB in all); peak RSS by the end "
            f"of loading {'unknown' if peak is None else f'{peak / GIB:.2f} GiB'}")
