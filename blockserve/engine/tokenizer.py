"""The tokenizer an engine for a given EngineConfig loads, without loading the model (for a front
end, such as the data-parallel router, that must tokenize exactly as its engines do)."""

from __future__ import annotations

from pathlib import Path

from blockserve.engine.config import EngineConfig


def load_tokenizer(engine_config: EngineConfig | None = None):
    """The tokenizer of `engine_config`'s model (default: the bundled one), or None if it has
    none. A GGUF file's is read from its metadata where the loader reads it so (loader.gguf_tokenizer),
    else it comes from the converted-model cache an engine wrote, else from the file."""
    from blockserve.models.default_model import default_model_path
    from blockserve.models.loader import TOKENIZER_FILES, cache_root, gguf_cache_entry, gguf_tokenizer

    model = None if engine_config is None else engine_config.model
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and (native := gguf_tokenizer(path)) is not None:
        return native
    from transformers import AutoTokenizer

    folder = path if path.is_dir() else gguf_cache_entry(path, cache_root())
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if path.is_file():  # a GGUF file no engine converted yet
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return None


def render_chat_template(template: str, messages: list, tools: list | None = None) -> str:
    """`template` over `messages` (and `tools`) as the engines render chat templates
    (models/chat_template.py), for a front end probing a template's text."""
    from blockserve.models.chat_template import render

    return render(template, messages, tools=tools)
