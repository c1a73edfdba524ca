"""Hypothesis profiles: CI explores a fixed set of examples, so a landing never hinges on luck;
local runs explore new ones each time (`HYPOTHESIS_PROFILE=dev`). Fixtures every test package
may use: one torch thread, and the SmolLM2 parity reference. CUDA is hidden, and Triton kernels run
in Triton's interpreter, unless BLOCKSERVE_TEST_CUDA=1."""

import os

import pytest
from hypothesis import settings

# The default suite is the CPU suite (CI has no GPU): on a machine with CUDA, device="auto" would move
# every engine there in bfloat16 and the float32 parity tests with it. BLOCKSERVE_TEST_CUDA=1 leaves
# CUDA visible (the CUDA-only tests then run); benchmarks/gpu_check.py is the GPU check.
# Without CUDA, Triton kernels (the `triton` attention backend) run in Triton's interpreter, which must
# be chosen before triton is first imported.
if os.environ.get("BLOCKSERVE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


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
def smollm2_transformers():
    """transformers' own load of the default GGUF (fp32): the parity reference, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from blockserve.models.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()
