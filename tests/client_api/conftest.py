"""One shared server per test session (model loading dominates the time), and the offline API in
this process as the reference for what the server streams. Both load at the same time."""

from __future__ import annotations

import pytest

from tests.client_api.server_process import ServerProcess


@pytest.fixture(scope="session")
def server_process(tmp_path_factory):
    """Started (port bound, model loading), not yet serving."""
    process = ServerProcess(tmp_path_factory.mktemp("server"))
    yield process
    process.stop()


@pytest.fixture(scope="session")
def offline_llm(server_process, default_tokenizer):
    """The offline API on the server's settings (same dtype and step budget), loaded while the
    server loads."""
    from scheduler_svc import LLM

    llm = LLM(dtype="float32", tokenizer=default_tokenizer, kv_cache_memory_bytes=64 << 20,
              max_model_len=256, max_num_batched_tokens=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(server_process, offline_llm):
    server_process.wait_serving()
    return server_process
