"""Every architecture blockserve/models/registry.py lists is held to transformers by a parity test,
and the refusal of one it does not list says what is supported and how to ask for more.

PARITY_SUITES is the shared list: each parity test module and, in it, the dicts of config builders
its tests parametrize over (every entry is run against transformers' own model on the same
weights). An architecture is covered when one of those configs is of it. A family added to the
registry without a tiny config in a parity suite fails here: add the config, or the suite.
"""

from __future__ import annotations

import importlib

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from blockserve.models.registry import ARCHITECTURES, model_class

PARITY_SUITES = {
    "tests.models.test_llama_tiny": ("CONFIGS",),
    "tests.models.test_gemma3": ("CONFIGS",),
    "tests.models.conftest": ("MLA_CONFIGS", "STATE_CONFIGS"),
    "tests.models.test_moe_families": ("MOE_CONFIGS",),
    "tests.models.test_dense_families": ("DENSE_CONFIGS",),
    "tests.models.test_gpt_oss": ("GPT_OSS_CONFIGS",),
}


def parity_architectures() -> dict[str, list[str]]:
    """architecture -> the parity configs (module:dict[key]) built of it."""
    covered: dict[str, list[str]] = {}
    for module_name, dicts in PARITY_SUITES.items():
        module = importlib.import_module(module_name)
        for dict_name in dicts:
            for key, build in getattr(module, dict_name).items():
                architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[build().model_type]
                covered.setdefault(architecture, []).append(f"{module_name}:{dict_name}[{key!r}]")
    return covered


def test_every_registered_architecture_has_a_parity_test():
    covered = parity_architectures()
    untested = sorted(set(ARCHITECTURES) - set(covered))
    assert not untested, (f"registry.py lists {untested} but no parity suite builds a config of them: add a tiny "
                          f"config to a parity test's dict and that dict to PARITY_SUITES ({__name__})")


def test_every_parity_architecture_is_registered():
    unregistered = sorted(set(parity_architectures()) - set(ARCHITECTURES))
    assert not unregistered, f"parity suites test {unregistered}, which registry.py does not list"


def test_unsupported_architecture_lists_the_supported_and_how_to_ask():
    with pytest.raises(ValueError) as refused:
        model_class(["GPT2LMHeadModel"])
    message = str(refused.value)
    assert "unsupported model architecture (GPT2LMHeadModel)" in message
    assert all(name in message for name in ARCHITECTURES)
    assert "open an issue" in message and "blockserve/models/registry.py" in message
    with pytest.raises(ValueError, match=r"\(none listed\)"):
        model_class(None)
