"""Factories for scheduler tests: configs, schedulers, prompts, fake model outputs, tokenizers."""

from __future__ import annotations

import weakref

import pytest
from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.executors.uni import UniProcExecutor

from .fake_worker import FakeWorker, fake_next_token


def make_config(**overrides) -> SchedulerConfig:
    fields = dict(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=1024)
    fields.update(overrides)
    return SchedulerConfig(**fields)


def make_scheduler(num_blocks: int = 1000, block_size: int = 16, vocab_size: int = 50_000,
                   eos_token_ids=(2,), tokenizer=None, **config) -> Scheduler:
    return Scheduler(make_config(**config), num_blocks, block_size, vocab_size, eos_token_ids,
                     tokenizer=tokenizer)


def make_prompt(n: int, start: int = 100) -> list[int]:
    """n distinct-looking token ids; different `start`s give prompts with no shared block."""
    return [start + i for i in range(n)]


def scheduled_tokens(so: worker_pb2.SchedulerOutput) -> dict[str, int]:
    """Wire id -> tokens scheduled this step, new requests first, in message order."""
    counts = {r.req_id: r.num_scheduled_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    counts.update(zip(cached.req_ids, cached.num_scheduled_tokens, strict=True))
    return counts


def fake_output(scheduler: Scheduler, so: worker_pb2.SchedulerOutput,
                tokens: dict[str, int] | int = 7) -> worker_pb2.ModelRunnerOutput:
    """What a worker would answer: a token for each request whose prefill is complete, nothing
    for those still mid-prefill. `tokens` is one token for all, or per wire id."""
    out = worker_pb2.ModelRunnerOutput()
    for req_id in scheduled_tokens(so):
        out.req_ids.append(req_id)
        entry = out.sampled_token_ids.add()
        request = scheduler.requests.get(req_id)
        if request is not None and request.num_computed_tokens >= request.num_tokens:
            entry.ids.append(tokens if isinstance(tokens, int) else tokens[req_id])
    return out


def run_step(scheduler: Scheduler, tokens: dict[str, int] | int = 7):
    """schedule() then update_from_output() with fake tokens; returns (so, outputs)."""
    so = scheduler.schedule()
    return so, update_with_text(scheduler, so, fake_output(scheduler, so, tokens))


_output_processors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def update_with_text(scheduler: Scheduler, so: worker_pb2.SchedulerOutput,
                     model_output: worker_pb2.ModelRunnerOutput):
    """update_from_output(), then, when the scheduler has a tokenizer, what the engine's caller
    does with its outputs: the output processor (text, stop strings), and stop_requests for the
    requests a stop string ended."""
    if scheduler.tokenizer is None:
        return scheduler.update_from_output(so, model_output)
    text = _output_processors.setdefault(scheduler, OutputProcessor(scheduler.tokenizer))
    requests = {r.request_id: r for r in scheduler.requests.values()}
    for request_id, r in requests.items():
        if request_id not in text:
            text.add_request(request_id, r.prompt_token_ids, r.sampling_params)
    outputs, stops = text.process(scheduler.update_from_output(so, model_output))
    text.process(scheduler.stop_requests([(requests[i], n, s) for i, (n, s) in stops.items()]))
    return outputs


def make_fake_engine(num_blocks: int, block_size: int, vocab_size: int = 64,
                     eos_token_ids=(1,), next_token=fake_next_token, tokenizer=None,
                     **config) -> tuple[EngineCore, FakeWorker]:
    cfg = make_config(block_size=block_size, **config)
    worker = FakeWorker(num_blocks, block_size, vocab_size, tuple(eos_token_ids),
                        max_model_len=cfg.max_model_len, next_token=next_token)
    return EngineCore(cfg, UniProcExecutor(cfg, worker), tokenizer), worker


class ByteTokenizer:
    """A byte-level tokenizer with a hand-made vocabulary: token i decodes to vocab[i] bytes, so
    a character's UTF-8 bytes can be split across tokens as in byte-level BPE."""

    eos_token_id = 0

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [b"<eos>", *pieces]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


@pytest.fixture
def byte_tokenizer():
    return ByteTokenizer


# The real default model, loaded once per session: float32 (the parity dtype), a KV pool of 12
# blocks of 16 tokens (the e2e workload needs ~20, so requests get preempted), and a budget of 48
# tokens cut into prefill chunks of 16 (so prompts are prefilled in pieces beside decodes).
E2E_NUM_BLOCKS = 12


@pytest.fixture(scope="session")
def e2e_llm(default_tokenizer):
    from scheduler_svc import LLM

    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 heads x 64, fp32
    llm = LLM(dtype="float32", tokenizer=default_tokenizer,
              kv_cache_memory_bytes=E2E_NUM_BLOCKS * block_bytes, max_model_len=96,
              max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16)
    assert llm.engine.scheduler.kv.pool.num_blocks == E2E_NUM_BLOCKS
    yield llm
    llm.shutdown()
