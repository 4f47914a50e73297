"""A worker's refusal is per request, through the async engine and its streams (fake worker, no
model): the `inf` repetition penalty is refused at admission before any worker call; with
admission bypassed, the worker refuses it and only its stream fails (INVALID_ARGUMENT naming the
field), beside 16 streams that finish with the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import math

import pytest
from batchwire.common import sampling_rules
from batchwire.common.refusals import StepRefused
from batchwire.v1 import generate_pb2, worker_pb2

from scheduler_svc import SamplingParams
from scheduler_svc.core.errors import InvalidRequestError, RequestRefusedError
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.service.status_codes import status_for
from scheduler_svc.service.wire import sampling_params
from tests.scheduler.conftest import make_fake_engine
from tests.scheduler.fake_worker import fake_greedy

VOCAB = 64


class CheckingWorker:
    """The fake worker behind the real worker's sampling rules: a new request breaking one is
    refused, the whole step unchanged, naming it (as worker_svc/batch/validation.py does)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.execute_calls = 0
        self.refusals = 0

    def execute_model(self, so):
        self.execute_calls += 1
        for new in so.scheduled_new_reqs:
            try:
                sampling_rules.check_values(new.sampling)
            except sampling_rules.SamplingRuleError as e:
                self.refusals += 1
                raise StepRefused(f"new request {new.req_id!r}: sampling.{e.field}={e}",
                                  [new.req_id]) from None
        return self.worker.execute_model(so)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def _engine() -> tuple[AsyncEngine, CheckingWorker]:
    core, fake = make_fake_engine(num_blocks=256, block_size=4, vocab_size=VOCAB, max_num_seqs=32,
                                  max_model_len=128)
    worker = CheckingWorker(fake)
    core.executor.worker = worker
    return AsyncEngine(core), worker


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _drain(stream) -> list[int]:
    ids = []
    async for out in stream:
        ids += out.new_token_ids
    return ids


def test_inf_repetition_penalty_is_refused_at_admission_with_no_worker_call():
    engine, worker = _engine()

    async def go():
        engine.start()
        with pytest.raises(InvalidRequestError) as e:
            sampling_params(generate_pb2.SamplingParams(repetition_penalty=math.inf))
        assert status_for(e.value)[0].name == "INVALID_ARGUMENT"
        assert e.value.field == "sampling.repetition_penalty"
        assert worker.execute_calls == 0
        stream = await engine.add_request("next", [4, 5, 6], _greedy(5))
        assert await _drain(stream) == fake_greedy([4, 5, 6], 5, VOCAB)

    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        engine.shutdown()


def test_a_refused_request_fails_alone_and_the_others_finish_undisturbed():
    engine, worker = _engine()
    scheduler = engine.core.replicas[0].core.scheduler
    prompts = [[3 + k, 7, 9 + k % 5] for k in range(16)]

    async def go():
        engine.start()
        streams = [await engine.add_request(f"s{k}", p, _greedy(12)) for k, p in enumerate(prompts)]
        tasks = [asyncio.ensure_future(_drain(s)) for s in streams]
        await asyncio.sleep(0.01)  # the 16 are under way (any point will do)
        bad = _greedy(12)
        bad.repetition_penalty = math.inf  # past admission: the hook that bypasses it
        refused = await engine.add_request("bad", [11, 12, 13], bad)
        with pytest.raises(RequestRefusedError) as e:
            await _drain(refused)
        code, message = status_for(e.value)
        assert code.name == "INVALID_ARGUMENT"
        assert e.value.field == "repetition_penalty" and "inf" in message
        for task, prompt in zip(tasks, prompts, strict=True):
            assert await task == fake_greedy(prompt, 12, VOCAB)
        after = await engine.add_request("after", [4, 5, 6], _greedy(5))
        assert await _drain(after) == fake_greedy([4, 5, 6], 5, VOCAB)
        await asyncio.wait_for(engine.wait_until_idle(), 10)
        assert engine.dead is None
        assert engine.stats.num_refused_requests == 1
        assert worker.refusals == 1

    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        engine.shutdown()
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks - 1  # all freed


class BitmaskRefusingWorker:
    """The fake worker refusing SampleTokens while the grammar bitmask has a row for `bad`,
    naming it; its logits stay parked, as the real worker's do."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.bad: str | None = None  # a wire id
        self.refusals = 0

    def sample_tokens(self, grammar):
        if grammar is not None and self.bad in grammar.req_ids:
            self.refusals += 1
            raise StepRefused(f"grammar bitmask row of {self.bad!r} allows no token", [self.bad])
        return self.worker.sample_tokens(grammar)

    def __getattr__(self, name):
        return getattr(self.worker, name)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_refused_bitmask_row_fails_its_request_alone(async_scheduling):
    core, fake = make_fake_engine(num_blocks=256, block_size=4, vocab_size=VOCAB, max_num_seqs=32,
                                  max_model_len=128, async_scheduling=async_scheduling)
    worker = BitmaskRefusingWorker(fake)
    core.executor.worker = worker
    scheduler = core.scheduler
    assert scheduler.async_scheduling == async_scheduling
    prompts = {f"s{k}": [3 + k, 7, 9 + k % 5] for k in range(16)}
    for req_id, prompt in prompts.items():
        core.add_request(prompt, _greedy(12), request_id=req_id)
    bad = core.add_request([11, 12, 13], _greedy(12), request_id="bad")
    worker.bad = bad.wire_id

    def bitmask(so):  # a constrained request's row, as a grammar would give it
        scheduled = {r.req_id for r in so.scheduled_new_reqs}
        scheduled |= set(so.scheduled_cached_reqs.req_ids)
        rows = [r for r in (bad.wire_id,) if r in scheduled and r in scheduler.requests]
        return (worker_pb2.GrammarOutput(req_ids=rows, bitmask=b"\xff" * 8 * len(rows))
                if rows else None)

    scheduler.get_grammar_bitmask = bitmask
    tokens: dict[str, list[int]] = {}
    finals = {}
    while core.has_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert worker.refusals == 1
    assert finals["bad"].finish_reason == "abort" and "allows no token" in finals["bad"].error
    assert {r: tokens[r] for r in prompts} == {r: fake_greedy(p, 12, VOCAB)
                                               for r, p in prompts.items()}
    assert scheduler.stats.num_refused_requests == 1
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks - 1
