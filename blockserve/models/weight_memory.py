"""What a loaded model's weights hold in memory, for the engine's start-up report.

    weights resident: 0.94 GiB bfloat16, 0.01 GiB float32 (1.0 GiB in all); peak RSS by the end of loading 1.2 GiB

Bytes are counted from the tensors' storages (each once: a tied head shares the embedding's), per
dtype; uint8 storages are a GGUF's packed quantized blocks. The peak RSS is the process's high-water
mark (VmHWM) when the report is made, which in a fresh process is the load's peak.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

GIB = 2 ** 30


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the model's parameters and buffers per dtype name ("bfloat16", "uint8", ...),
    each storage counted once; tensors on the meta device hold none."""
    seen: set[int] = set()
    held: dict[str, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        name = str(tensor.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + storage.nbytes()
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
    parts = ", ".join(f"{size / GIB:.3f} GiB {'uint8 (GGUF blocks)' if name == 'uint8' else name}"
                      for name, size in held)
    peak = peak_rss_bytes()
    return (f"weights resident: {parts} ({sum(size for _, size in held) / GIB:.3f} GiB in all); peak RSS by the end "
            f"of loading {'unknown' if peak is None else f'{peak / GIB:.2f} GiB'}")
