"""The disk tier under tensor parallelism, 2 gloo ranks of one thread each, on a tiny random Llama whose
2 KV heads are sharded (each rank's entry of a block holds other bytes): a prompt's blocks are written by
both ranks, a restarted engine serves the same prompt from the tier with TP=1's greedy tokens; a damaged
or missing entry on rank 1 alone makes exactly that block and the ones after it recompute on both ranks,
with the same tokens; rank 0's stats count rank 1's writes (and its failed one) too; another
tensor-parallel size never hits; a rank that does not see rank 0's
directory is refused at start-up; a rank whose writes stop (its disk fails) stops rank 0 offering writes,
with a warning naming it, while what every rank holds is still served; a hybrid's state checkpoints come
back per rank too.

Each TP=2 engine spawns a rank process (~5-10 s here): the default suite runs one test, `-m tp_full` the
others.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.models.random_checkpoint import save_random_model
from tests.distributed.processes import child_pids
from tests.models.conftest import STATE_CONFIGS
from tests.server_process import free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
ENGINE = dict(num_threads=1, block_size=4, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=32,
              check_integrity=True, poison=True)
PROMPT = [(37 * i + 11) % 500 + 1 for i in range(60)]  # 15 blocks; a hit leaves the last token: 14 (56 tokens)
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


def ask(llm: LLM) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens not computed) of PROMPT."""
    output = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    return output.outputs[0].token_ids, output.num_cached_tokens


def entries(directory) -> list[str]:
    return [n for _, _, names in os.walk(directory) for n in names if n.endswith(".kv")]


@pytest.mark.slow  # three engines, two of them with a rank process: ~20 s
def test_tp2_serves_a_restart_from_disk_and_a_bad_entry_on_one_rank_recomputes_on_both(llama, tmp_path):
    before = child_pids()
    with LLM(llama, **ENGINE) as tp1:
        expected, _ = ask(tp1)
    directory = str(tmp_path / "kv")
    with LLM(llama, tensor_parallel_size=2, kv_offload_dir=directory, **ENGINE) as cold:
        assert ask(cold) == (expected, 0)
        store = cold.engine.core.kv_offload
        store.flush()
        own = store.writer_counts()
        deadline = time.monotonic() + 30
        while (disk := cold.engine.stats().kv_offload.tiers[0]).writes < 2 * own.writes[0]:  # rank 1 reports
            assert time.monotonic() < deadline, "rank 0's stats never counted rank 1's writes"
            time.sleep(0.2)
        assert (disk.writes, disk.bytes_written) == (2 * own.writes[0], 2 * own.bytes_written[0])
        assert disk.writes == len(entries(directory)) and disk.write_failures == 0
    written = entries(directory)  # closing wrote both ranks' queues
    assert len(written) >= 2 * 14 and len(written) % 2 == 0

    with LLM(llama, tensor_parallel_size=2, kv_offload_dir=directory, **ENGINE) as llm:
        store = llm.engine.core.kv_offload
        hashes = llm.engine.core.kv.new_block_hashes().get(4, PROMPT)
        keys = [store.key(0, h) for h in hashes]  # (rank 0's entry, rank 1's entry) per block
        disk = store.tiers[0]
        assert all(os.path.exists(disk.path(k)) for key in keys[:14] for k in key)
        assert ask(llm) == (expected, 56)
        assert llm.engine.stats().prefix_cache_tier_hits == 56

        assert llm.engine.reset_prefix_cache().ok
        with open(disk.path(keys[6][1]), "r+b") as f:  # rank 1's entry of block 6: one byte flipped
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        assert ask(llm) == (expected, 24)  # blocks 0-5 from the tier, 6 on computed on both ranks

        assert llm.engine.reset_prefix_cache().ok
        os.unlink(disk.path(keys[3][1]))  # rank 1's entry of block 3: gone
        assert ask(llm) == (expected, 12)
        stats = llm.engine.stats()
        assert stats.prefix_cache_tier_hits == 56 + 24 + 12
        assert stats.kv_offload.tiers[0].load_failures == 1
    assert not child_pids() - before  # rank 1 has exited


FAIL_WRITES_HOOK = """\
import errno
import os

from blockserve.kv.tiers import disk

_write = disk.DiskTier.write


def write(self, key, payload):
    if os.path.exists(os.environ["BLOCKSERVE_TEST_FAIL_WRITES"]):
        raise OSError(errno.EIO, "input/output error (injected)")
    return _write(self, key, payload)


disk.DiskTier.write = write
"""


@pytest.mark.slow  # an engine with a rank process and up to a dozen prompts: ~10 s
@pytest.mark.tp_full
def test_a_rank_whose_writes_stop_stops_rank_0_offering_writes(llama, tmp_path, monkeypatch, caplog):
    """Rank 1's disk writes fail once a flag file exists (a sitecustomize only its interpreter loads): rank 0
    learns it, warns naming rank 1 and orders no more saves; the blocks both ranks wrote before are still hits."""
    from blockserve.distributed import executor

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_WRITES_HOOK)
    flag = tmp_path / "rank1-disk-fails"
    monkeypatch.setenv("BLOCKSERVE_TEST_FAIL_WRITES", str(flag))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), *sys.path]))
    monkeypatch.setattr(executor, "WRITES_POLL_S", 0.0)  # rank 0 asks at every step that orders saves
    directory = str(tmp_path / "kv")
    with LLM(llama, tensor_parallel_size=2, kv_offload_dir=directory, **ENGINE) as llm, \
            caplog.at_level(logging.WARNING, logger="blockserve"):
        store = llm.engine.core.kv_offload
        expected, cached = ask(llm)
        assert cached == 0
        hashes = llm.engine.core.kv.new_block_hashes().get(4, PROMPT)
        keys = [store.key(0, h) for h in hashes[:14]]
        deadline = time.monotonic() + 60
        while not all(store.tiers[0].contains(k) for key in keys for k in key):  # rank 1 writes on its own time
            assert time.monotonic() < deadline, "rank 1 never wrote PROMPT's entries"
            time.sleep(0.1)

        flag.touch()
        for i in range(12):  # rank 1's writer fails, it says so after a step, rank 0 reads it at a step with saves
            llm.generate([[(11 * j + 7 * i) % 500 + 1 for j in range(40)]], GREEDY, use_tqdm=False)
            if not store.stats().writing:
                break
            time.sleep(0.2)
        assert not store.stats().writing, "rank 0 still offers writes rank 1 can never complete"
        assert "rank 1" in caplog.text and "injected" in caplog.text
        assert caplog.text.count("tensor-parallel rank 1") == 1  # warned once

        store.flush()
        before = store.writer_counts()
        llm.generate([[(13 * j + 5) % 500 + 1 for j in range(40)]], GREEDY, use_tqdm=False)
        assert store.writer_counts() == before
        assert store.is_idle()  # no save was even claimed
        deadline = time.monotonic() + 30
        while llm.engine.stats().kv_offload.tiers[0].write_failures == 0:  # rank 1's failed write, as it reports it
            assert time.monotonic() < deadline, "rank 0's stats never counted rank 1's failed write"
            time.sleep(0.2)

        assert llm.engine.reset_prefix_cache().ok
        assert ask(llm) == (expected, 56)  # both ranks' entries of PROMPT are still read


@pytest.mark.slow  # three engines, one with a rank process: ~15 s
@pytest.mark.tp_full
def test_another_tensor_parallel_size_gets_no_hit(llama, tmp_path):
    directory = str(tmp_path / "kv")
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as tp1:
        expected, cached = ask(tp1)
    assert cached == 0 and entries(directory)
    with LLM(llama, tensor_parallel_size=2, kv_offload_dir=directory, **ENGINE) as tp2:
        assert ask(tp2) == (expected, 0)
        assert tp2.engine.stats().prefix_cache_tier_hits == 0
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as again:  # TP=1's entries are still there for TP=1
        assert ask(again) == (expected, 56)


@pytest.mark.slow  # a rank process: ~8 s
@pytest.mark.tp_full
def test_a_rank_that_does_not_see_rank_0_s_directory_is_refused_at_start_up(llama, tmp_path, monkeypatch):
    """Rank 1 as its own program in another working directory: the relative kv_offload_dir names another
    directory there, as a rank on a host without the shared file system would see."""
    for side in ("rank0", "rank1"):
        (tmp_path / side).mkdir()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "blockserve.distributed.worker"], cwd=tmp_path / "rank1",
                              env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        monkeypatch.chdir(tmp_path / "rank0")
        for key, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ValueError, match="rank 1 could not use --kv-offload-dir: .*does not see rank 0's"):
            LLM(llama, tensor_parallel_size=2, distributed_executor="external", kv_offload_dir="kv", **ENGINE)
        assert worker.wait(timeout=30) == 0  # it reported and left
    finally:
        worker.kill()
        worker.wait()
    assert not os.listdir(tmp_path / "rank0" / "kv")  # the marker is gone


@pytest.mark.slow  # three engines on a hybrid, two with a rank process: ~50 s on a busy 2-core machine
@pytest.mark.tp_full
def test_a_tp2_hybrid_resumes_from_each_rank_s_state_checkpoint_on_disk(tmp_path):
    """Qwen3-Next (Gated DeltaNet + attention, checkpoint stride 64): each rank's state slot holds its own
    heads, so its checkpoint is its own entry too; a restart resumes from both ranks' checkpoints."""
    path = tmp_path / "qwen3_next"
    save_random_model(STATE_CONFIGS["qwen3_next"](), path)
    history = [(13 * i) % 500 + 1 for i in range(150)]
    engine = dict(num_threads=1, block_size=4, max_model_len=192, check_integrity=True, poison=True)
    with LLM(str(path), **engine) as tp1:
        expected = tp1.generate([history + [8, 9]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    directory = str(tmp_path / "kv")
    with LLM(str(path), tensor_parallel_size=2, kv_offload_dir=directory, **engine) as cold:
        assert cold.generate([history + [5, 6, 7]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    with LLM(str(path), tensor_parallel_size=2, kv_offload_dir=directory, **engine) as restarted:
        output = restarted.generate([history + [8, 9]], GREEDY, use_tqdm=False)[0]
        stats = restarted.engine.stats()
    assert (output.outputs[0].token_ids, output.num_cached_tokens) == (expected, 128)
    assert stats.prefix_cache_tier_hits == 128
    assert stats.kv_offload.tiers[0].hits == 2 * (128 // 4 + 1)  # each rank's blocks and state checkpoint
