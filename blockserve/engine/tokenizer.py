"""The tokenizer an engine for a given EngineConfig loads, without loading the model (for a front
end, such as the data-parallel router, that must tokenize exactly as its engines do)."""

from __future__ import annotations

from pathlib import Path

from blockserve.engine.config import EngineConfig


def load_tokenizer(engine_config: EngineConfig):
    """The model's tokenizer (from a GGUF file: from the converted-model cache its engines wrote),
    or None if the model has none."""
    from transformers import AutoTokenizer

    from blockserve.models.default_model import default_model_path
    from blockserve.models.loader import TOKENIZER_FILES, cache_root, gguf_cache_entry

    path = default_model_path() if engine_config.model is None else Path(engine_config.model).expanduser()
    folder = path if path.is_dir() else gguf_cache_entry(path, cache_root())
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
