"""The bundled SmolLM2's tokenizer (from the engine's converted-GGUF cache when it is there)."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from blockserve.models.default_model import default_model_path
    from blockserve.models.loader import cache_root, gguf_cache_entry

    path = default_model_path()
    entry = gguf_cache_entry(path, cache_root())
    if entry.is_dir():
        return AutoTokenizer.from_pretrained(entry, local_files_only=True)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
