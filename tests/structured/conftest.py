"""The bundled SmolLM2's tokenizer (from the engine's converted-GGUF cache when it is there)."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from blockserve.engine.tokenizer import load_tokenizer

    return load_tokenizer()
