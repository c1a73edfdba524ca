"""Starting a tensor-parallel engine's ranks: an engine built at the top level of a script with no
`if __name__ == "__main__":` guard (a first script, a notebook) answers, since no rank imports
the script; a rank that exits during start-up fails the start at once with that rank's own error
(here: its `import torch` fails), and no process is left; one that dies in the rendezvous itself
fails it within distributed_timeout_s with its own error too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from transformers import LlamaConfig

from blockserve.distributed.executor import TensorParallelExecutor
from blockserve.engine.llm import LLM
from blockserve.models.random_checkpoint import save_random_model
from tests.distributed.processes import child_pids

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # rank processes

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
ENGINE = dict(num_threads=1, kv_cache_memory="8MiB", max_model_len=128)
STARTUP_TIMEOUT_S = 60  # what a start that hangs would wait for: far past what these checks allow

UNGUARDED = """\
import sys

from blockserve import LLM, SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_startup_timeout_s=float(sys.argv[2]), **{engine!r})
output = llm.generate([[5, 17, 301, 42]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("answered", output[0].outputs[0].token_ids)
llm.close()
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


def test_an_unguarded_script_with_tp2_answers(model_path, tmp_path):
    script = tmp_path / "first_script.py"
    script.write_text(UNGUARDED.format(engine=ENGINE))
    answer = subprocess.run([sys.executable, str(script), model_path, str(STARTUP_TIMEOUT_S)], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=2 * STARTUP_TIMEOUT_S)
    assert answer.returncode == 0, answer.stderr[-3000:]
    assert "answered [" in answer.stdout
    assert "bootstrapping phase" not in answer.stderr


def test_a_rank_that_dies_at_import_fails_the_start_at_once(model_path, tmp_path, monkeypatch):
    """Rank 1's interpreter finds a `torch` that cannot be imported first on its path (a broken
    install); this process imported the real one before PYTHONPATH changed."""
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this torch install is broken")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(broken.parent), os.environ.get("PYTHONPATH", "")]))
    executors = []  # held here, so the check below sees the ranks this start made
    start = TensorParallelExecutor.__init__

    def recorded(self, *args, **kwargs):
        executors.append(self)
        start(self, *args, **kwargs)

    monkeypatch.setattr(TensorParallelExecutor, "__init__", recorded)
    before = child_pids()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with status 1 during start-up(.|\n)*"
                                           r"ImportError: this torch install is broken"):
        LLM(model_path, tensor_parallel_size=2, distributed_startup_timeout_s=STARTUP_TIMEOUT_S, **ENGINE)
    assert time.monotonic() - began < STARTUP_TIMEOUT_S / 3  # at once: not the start-up timeout
    (executor,) = executors
    (rank1,) = executor.processes
    assert rank1.returncode == 1  # reaped
    assert not child_pids() - before


def test_a_rank_that_dies_while_joining_fails_the_start_within_the_step_timeout(model_path, tmp_path, monkeypatch):
    """Rank 1 imports everything and says it is joining, then cannot reach rank 0 (its rendezvous
    raises, through a sitecustomize only its interpreter loads): rank 0, already in the rendezvous,
    gives up within distributed_timeout_s (not the start-up timeout) and names the rank's error."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import torch.distributed\n\n\n"
        "def unreachable(*args, **kwargs):\n"
        "    raise ConnectionError('rank 0 is unreachable from here')\n\n\n"
        "torch.distributed.rendezvous = unreachable\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    before = child_pids()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with status 1 during start-up(.|\n)*"
                                           r"ConnectionError: rank 0 is unreachable from here"):
        LLM(model_path, tensor_parallel_size=2, distributed_startup_timeout_s=STARTUP_TIMEOUT_S,
            distributed_timeout_s=1, **ENGINE)
    assert time.monotonic() - began < STARTUP_TIMEOUT_S / 3
    assert not child_pids() - before
