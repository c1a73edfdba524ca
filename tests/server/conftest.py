"""One `blockserve serve` on the bundled SmolLM2 shared by the structured-output and tool-calling
tests (a server start costs ~15 s), torn down after this package's tests."""

from __future__ import annotations

import openai
import pytest

from tests.server_process import ServerProcess

BUNDLED_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--max-num-seqs", "16",
                "--num-threads", "1"]


@pytest.fixture(scope="package")
def bundled_server():
    with ServerProcess(BUNDLED_ARGS) as proc:
        yield proc


@pytest.fixture(scope="package")
def bundled_client(bundled_server):
    return openai.OpenAI(base_url=f"{bundled_server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
