"""An engine whose start-up fails after its tensor-parallel ranks are up (here: a KV budget too
small for one request, found only once every rank has loaded its shard) stops those ranks at
once and raises the original, clear error; nothing waits for the garbage collector."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from blockserve.distributed.executor import TensorParallelExecutor
from blockserve.engine.llm import LLM
from blockserve.models.random_checkpoint import save_random_model
from tests.distributed.processes import child_pids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie awaiting its reaper)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow  # rank processes
def test_a_start_up_failure_after_the_ranks_started_stops_them_and_keeps_the_error(tmp_path, monkeypatch):
    save_random_model(LlamaConfig(**SIZES), tmp_path)
    executors = []  # held here, so only an explicit stop (never GC) can end the ranks
    start = TensorParallelExecutor.__init__

    def recorded(self, *args, **kwargs):
        executors.append(self)
        start(self, *args, **kwargs)

    monkeypatch.setattr(TensorParallelExecutor, "__init__", recorded)
    before = child_pids()
    with pytest.raises(ValueError, match="KV cache budget of 0.01 MiB cannot hold even one request") as error:
        LLM(str(tmp_path), tensor_parallel_size=2, num_threads=1, kv_cache_memory="8KiB", max_model_len=128)
    assert "tensor-parallel" not in str(error.value)  # the engine's own error, not a rank fault it caused
    (executor,) = executors
    (rank1,) = executor.processes
    assert rank1.pid is not None and executor.kv_memory_bytes == 8 * 2**10  # it got past the ranks' start
    assert not running(rank1.pid) and rank1.returncode is not None
    assert not child_pids() - before
