"""Embedding requests through EngineCore and LLM.embed on a tiny model in this process: the
vectors equal transformers' pooled final hidden states (chunked inputs included), no embedding
step calls SampleTokens, blocks are freed once a request is pooled, and mean pooling turns the
prefix cache off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from scheduler_svc import LLM, SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.executors.uni import UniProcExecutor
from worker_svc.runner.worker import Worker

from .conftest import ByteTokenizer

# A 32-token budget chunks the 70-token input over three steps.
SETTINGS = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_seqs=8,
                max_model_len=256, max_num_batched_tokens=32)
INPUTS = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (5, 70, 17, 1, 33)]


class CountingWorker:
    """The real worker, counting the calls the engine makes on it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        method = getattr(self.worker, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args)
        return counted


@pytest.fixture(scope="module", params=["mean", "last"])
def embed_llm(request, tiny_llama):
    pooling = request.param
    config = SchedulerConfig(model=tiny_llama, task="embed", pooling_type=pooling, **SETTINGS)
    worker = CountingWorker(Worker(config.worker_config()))
    tokenizer = ByteTokenizer([bytes([65 + i % 26]) for i in range(512)])
    llm = LLM(tiny_llama, tokenizer=tokenizer, task="embed", pooling_type=pooling,
              executor=UniProcExecutor(config, worker), **SETTINGS)
    yield llm, worker, pooling
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    return transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_embed_equals_transformers_without_sample_tokens(embed_llm, hf_tiny):
    llm, worker, pooling = embed_llm
    scheduler = llm.engine.scheduler
    assert scheduler.kv.enable_prefix_caching == (pooling == "last")
    steps_before = scheduler.stats.num_steps
    calls_before = worker.calls.get("execute_model", 0)
    vectors = llm.embed([{"prompt_token_ids": ids} for ids in INPUTS])
    assert scheduler.stats.num_steps - steps_before >= 3  # the 70-token input took three steps
    num_steps = scheduler.stats.num_steps - steps_before
    assert worker.calls["execute_model"] - calls_before == num_steps
    assert "sample_tokens" not in worker.calls  # every step answered in ExecuteModel
    for ids, ours in zip(INPUTS, vectors, strict=True):
        with torch.no_grad():
            hidden = hf_tiny(torch.tensor([ids])).last_hidden_state[0]
        expected = F.normalize(hidden.mean(0) if pooling == "mean" else hidden[-1], dim=0)
        assert float(torch.tensor(ours) @ expected) >= 0.9999
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks - 1  # all freed
    assert not llm.engine.requests  # finished (their ids reach the worker in the next step)


def test_truncated_unnormalised_and_refused(embed_llm):
    llm, _, _ = embed_llm
    full, short = llm.embed([[5, 6, 7]], normalize=False)[0], llm.embed(
        [[5, 6, 7]], normalize=False, dimensions=16)[0]
    assert len(full) == 64 and short == pytest.approx(full[:16], rel=1e-5)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed([[5]], dimensions=65)
    with pytest.raises(InvalidRequestError, match="task"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
