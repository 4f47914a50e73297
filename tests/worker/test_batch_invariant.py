"""Batch-invariant mode through the offline API: one greedy request gives the same tokens and the
same logprobs, bit for bit, alone and beside 1, 7 and 63 others of mixed lengths, first, last or
in the middle of the batch, its prompt prefilled in one chunk or several, with and without a
prefix-cache hit, in float32 and bfloat16.

The tiny random Llama shows it: its float32 matmuls round a row differently at every batch size
on a CPU (`benchmarks/engine/row_invariance.py`), and its 2 KV heads of 4 query heads take the
same attention paths as the real model's. Without the mode the same runs give other logprobs
(docs/performance.md has the default model's figures).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from batchwire.v1 import worker_pb2

from scheduler_svc.core.outputs import TokenLogprobs
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.llm import LLM

BUDGET = 64  # tokens per step: the target's 40-token prompt fits one step alone, not beside others
TARGET = [(7 * i + 3) % 500 + 3 for i in range(40)]  # 2 full blocks of 16, then 8 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)


@dataclasses.dataclass
class TargetRun:
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    prefill_chunks: list[int]  # tokens computed per step until the prompt was done
    num_cached_tokens: int  # prompt tokens read from the prefix cache


class StepSpy:
    """Wraps the executor's execute_model to see how the target's prompt was scheduled."""

    def __init__(self, llm: LLM) -> None:
        self.executor = llm.engine.executor
        self.execute_model = self.executor.execute_model
        self.executor.execute_model = self._execute_model  # type: ignore[method-assign]
        self.reset()

    def reset(self) -> None:
        self.wire_id: str | None = None
        self.chunks: list[int] = []
        self.cached = 0

    def _execute_model(self, so: worker_pb2.SchedulerOutput, *args, **kwargs):
        for new in so.scheduled_new_reqs:
            if list(new.prompt_token_ids) == TARGET:
                self.wire_id, self.cached = new.req_id, new.num_computed_tokens
                self.chunks.append(new.num_scheduled_tokens)
        cached = so.scheduled_cached_reqs
        if self.wire_id in cached.req_ids:
            i = list(cached.req_ids).index(self.wire_id)
            if cached.num_computed_tokens[i] < len(TARGET):
                self.chunks.append(cached.num_scheduled_tokens[i])
        return self.execute_model(so, *args, **kwargs)


def others(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """count greedy requests of mixed prompt (3..80) and output (1..12) lengths."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 512) for _ in range(rng.randint(3, 80))],
         SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=True))
        for _ in range(count)
    ]


def run_target(llm: LLM, spy: StepSpy, neighbours: list, position: int,
               cold_cache: bool = True) -> TargetRun:
    """Runs the target at `position` among the neighbours; a cold cache forgets earlier runs."""
    if cold_cache:
        assert llm.engine.scheduler.kv.reset_prefix_cache()
    batch = list(neighbours)
    batch.insert(position, (TARGET, GREEDY))
    spy.reset()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [s for _, s in batch],
                           use_tqdm=False)
    target = outputs[position]
    assert target.logprobs is not None and len(target.token_ids) == GREEDY.max_tokens
    return TargetRun(target.token_ids, target.logprobs, spy.chunks, spy.cached)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def invariant_llm(request, tiny_llama_with_tokenizer):
    llm = LLM(model=tiny_llama_with_tokenizer, dtype=request.param, batch_invariant=True,
              max_num_batched_tokens=BUDGET, max_num_seqs=64, max_model_len=256,
              kv_cache_memory_bytes=16 << 20)
    yield llm, StepSpy(llm)
    llm.shutdown()


def test_a_greedy_request_is_bitwise_the_same_under_any_batch(invariant_llm):
    llm, spy = invariant_llm
    alone = run_target(llm, spy, [], 0)
    assert alone.prefill_chunks == [len(TARGET)] and alone.num_cached_tokens == 0

    runs = {
        "beside 1, first": run_target(llm, spy, others(1, seed=1), 0),
        "beside 7, last": run_target(llm, spy, others(7, seed=7), 7),
        "beside 63, in the middle": run_target(llm, spy, others(63, seed=63), 31),
        "beside 7, first, prefix-cache hit": run_target(
            llm, spy, others(7, seed=8), 0, cold_cache=False),
        "alone, prefix-cache hit": run_target(llm, spy, [], 0, cold_cache=False),
    }
    # The runs cover what they claim: prefill in several chunks, and prefix-cache hits.
    assert len(runs["beside 7, last"].prefill_chunks) > 1
    assert len(runs["beside 63, in the middle"].prefill_chunks) > 1
    assert runs["beside 63, in the middle"].num_cached_tokens == 0
    assert runs["alone, prefix-cache hit"].num_cached_tokens == 32
    assert runs["beside 7, first, prefix-cache hit"].num_cached_tokens == 32
    for name, run in runs.items():
        assert run.token_ids == alone.token_ids, name
        assert run.logprobs == alone.logprobs, name  # floats compared exactly
