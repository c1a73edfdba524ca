"""The supported-models table, generated from the registry (registry.py) and the loaders: one row per
`architectures` name, with the checkpoints people know it by, its layer kinds, the formats it loads
from (a Hugging Face directory always; GGUF where models/loader.py reads that architecture), whether it
shards over tensor-parallel ranks, and the tests that hold it to transformers.

    python -m blockserve.models.catalog     prints it, as docs/models.md holds it
"""

from __future__ import annotations

from blockserve.models.loader import gguf_architectures
from blockserve.models.registry import ARCHITECTURES, model_class

HEADER = ("family", "`architectures` name", "layer kinds", "formats", "tensor parallel", "tested by (under tests/)")


def supported_models_table() -> str:
    """The table as Markdown, one row per registered architecture, sorted by name."""
    gguf = gguf_architectures()
    rows = [HEADER, ("---",) * len(HEADER)]
    for name in sorted(ARCHITECTURES):
        entry = ARCHITECTURES[name]
        rows.append((
            entry.family,
            f"`{name}`",
            entry.layer_kinds,
            "HF, GGUF" if name in gguf else "HF",
            "yes" if model_class([name]).supports_tensor_parallel else "no",
            ", ".join(f"`{path}`" for path in entry.tested),
        ))
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def main() -> None:
    print(supported_models_table(), end="")


if __name__ == "__main__":
    main()
