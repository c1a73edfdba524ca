"""Hypothesis profiles: CI explores a fixed set of examples, so a landing never hinges on luck;
local runs explore new ones each time (`HYPOTHESIS_PROFILE=dev`)."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own load of the default GGUF (fp32): the parity reference, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from blockserve.models.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()
