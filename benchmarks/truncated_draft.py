"""A draft model for the bundled one: its first N decoder layers, the embedding, final norm and head
as they are (same blocks, same tokenizer), written as a GGUF file with gguf-py, llama.cpp's own
reader and writer of the format.

    python -m benchmarks.truncated_draft --layers 6 --out /tmp/smollm2-6-layers.gguf
    python -m benchmarks.spec_decode --methods draft_model --draft-model /tmp/smollm2-6-layers.gguf

No smaller model of SmolLM2's vocabulary ships offline; a truncated copy is the usual stand-in
for timing a draft-model pair (its drafts match the target's less often than a trained draft's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from blockserve.models.loader import default_model_path


def truncate(source: Path, out: Path, layers: int) -> None:
    """Write `source` with only its first `layers` blocks (ValueError if it has no more than that)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    block_count = f"{arch}.block_count"
    if not 0 < layers < reader.fields[block_count].contents():
        raise ValueError(f"--layers must be in [1, {reader.fields[block_count].contents() - 1}], got {layers}")
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        value = layers if name == block_count else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=None, help="default: the bundled model")
    args = parser.parse_args()
    truncate(args.source or default_model_path(), args.out, args.layers)


if __name__ == "__main__":
    main()
