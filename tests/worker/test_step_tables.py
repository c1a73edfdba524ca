"""A step's block tables are only as wide as its longest context needs (worker/input_batch.py):
the same tokens and logprobs as full-width tables, for every backend and kind of attention layer,
eager and replayed from captured decode graphs, whose static tables then hold stale columns."""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.worker import input_batch
from blockserve.worker.input_batch import step_table_width
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 (a fixture)
from tests.worker.test_cuda_graphs import SIZES, FrozenCapture, assert_same, gemma3_path  # noqa: F401 (a fixture)
from tests.worker.test_sync_free import llama_path, save_tiny_llama  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 2
MAX_MODEL_LEN = 256  # tables of 128 columns; the contexts below need 3 to 39
# (prompt length, new tokens): the longest context needs 16, 32 and 64 columns in turn, and the
# long requests end first, so later steps are narrower than earlier ones.
REQUESTS = ((70, 8), (40, 4), (5, 16), (12, 14))


def test_step_table_width():
    assert [step_table_width(n, 128) for n in (1, 16, 17, 33, 64, 65, 128)] == [16, 16, 32, 64, 64, 128, 128]
    assert step_table_width(3, 4) == 4  # never past the capacity
    assert step_table_width(100, 100) == 100


def engine(path, backend: str) -> LLM:
    return LLM(model=str(path), attention_backend=backend, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=4, max_num_batched_tokens=32, seed=0, kv_cache_memory=256 * 1024)


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n, _ in REQUESTS]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0) for _, n in REQUESTS]
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        out.append((c.token_ids, [entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids)]))
    return out


@pytest.fixture
def widths(monkeypatch) -> list[int]:
    """Every step table's width, as chosen."""
    chosen = []

    def spy(needed: int, capacity: int) -> int:
        chosen.append(step_table_width(needed, capacity))
        return chosen[-1]

    monkeypatch.setattr(input_batch, "step_table_width", spy)
    return chosen


def full_width(path, backend: str, monkeypatch) -> list[tuple[list[int], list[float]]]:
    with monkeypatch.context() as patch:
        patch.setattr(input_batch, "MIN_STEP_TABLE_WIDTH", MAX_MODEL_LEN)
        return generate(engine(path, backend))


@pytest.mark.parametrize(("family", "backend"), [
    ("llama", "exact"), ("llama", "whole_block"), ("llama", "flex"), ("llama", "triton"),
    ("gemma3", "exact"), ("gemma3", "flex"), ("deepseek_v3", "exact"), ("deepseek_v3", "whole_block"),
    ("deepseek_v3", "flex")])
def test_narrow_step_tables_give_the_full_width_outputs(family, backend, request, tiny_model, monkeypatch, widths):
    """Full attention (the CPU's native decode kernel with 'exact'), sliding windows (Gemma 3) and
    MLA (DeepSeek-V3): exactly the outputs of full-width tables."""
    path = request.getfixturevalue(f"{family}_path") if family != "deepseek_v3" else tiny_model(family)[0]
    expected = full_width(path, backend, monkeypatch)
    widths.clear()
    assert generate(engine(path, backend)) == expected
    assert {16, 32, 64} <= set(widths) and max(widths) < MAX_MODEL_LEN // BLOCK_SIZE


@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_replayed_steps_read_no_stale_column(backend, llama_path, monkeypatch, widths):
    """Captured decode graphs hold full-width tables and copy in only a step's columns: after a wide
    step, a narrower one leaves stale block ids past every row's length, which must not be read. The
    tokens of full-width eager steps, and their logprobs to float rounding (a padded bucket is a
    matmul of more rows)."""
    monkeypatch.setenv("BLOCKSERVE_NATIVE_KERNELS", "0")
    expected = full_width(llama_path, backend, monkeypatch)
    llm = engine(llama_path, backend)
    capture = FrozenCapture(fake=False)
    llm.engine.capture_decode_graphs(SIZES, capture)
    widths.clear()
    assert_same(generate(llm), expected)
    assert capture.replays and widths[-1] == 16 and 64 in widths
    graphs = llm.engine.core.runner.graphs
    for g, shared in graphs.tables.items():  # one table for every size: size B's is its first B rows
        assert all(graph.tables[g].data_ptr() == shared.data_ptr() for graph in graphs.graphs.values())
        assert shared[:, 16:].any()  # stale ids from the wide steps, left in place


@pytest.fixture(scope="module")
def long_llama_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama_long"), max_position_embeddings=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_narrow_step_tables_on_cuda(long_llama_path, backend, monkeypatch, widths):
    """On the GPU's kernels, eager and replayed (block size 16, tables of 64 columns; steps of 32, then
    16 once the long prompt ends): full-width eager steps' tokens."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (300, 20, 45)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 12, 10)]
    outs = []
    for full, options in ((True, dict(enforce_eager=True)), (False, dict(enforce_eager=True)),
                          (False, dict(cuda_graph_sizes=(1, 2, 4)))):
        with monkeypatch.context() as patch:
            if full:
                patch.setattr(input_batch, "MIN_STEP_TABLE_WIDTH", 1024)
            with LLM(model=str(long_llama_path), device="cuda", dtype="float32", attention_backend=backend,
                     max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=64, seed=0,
                     kv_cache_memory=4 << 20, **options) as llm:
                outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]
    assert {16, 32} <= set(widths)
