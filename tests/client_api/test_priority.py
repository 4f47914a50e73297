"""`priority` from the client API to the scheduler, through the Generation servicer in this
process over the fake worker (no model, no server process)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.service.generation_request import parse
from scheduler_svc.service.generation_servicer import GenerationServicer
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.status_codes import status_for
from tests.client_api.test_async_engine import SlowWorker, run
from tests.scheduler.conftest import make_fake_engine

VOCAB = 64


def _servicer(policy: str) -> tuple[GenerationServicer, AsyncEngine]:
    """One request runs at a time, so the others wait in the scheduler's queue."""
    core, worker = make_fake_engine(num_blocks=64, block_size=4, vocab_size=VOCAB,
                                    max_num_seqs=1, max_model_len=128, policy=policy)
    core.executor.worker = SlowWorker(worker)
    engine = AsyncEngine(core)
    servicer = GenerationServicer("test", 4 << 20)
    servicer.attach(LoadedModel(
        engine=engine, tokenizer=None, config=core.config, model_name="fake", vocab_size=VOCAB,
        max_model_len=128, max_num_seqs=1,
        max_num_batched_tokens=core.config.max_num_batched_tokens, eos_token_ids=[1],
        dtype="float32", transport="uni", workers=list))
    return servicer, engine


def _request(request_id: str, max_tokens: int, priority: int = 0) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=request_id, token_ids=[5, 6, 7, 8, 9], priority=priority,
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True))


def test_priority_orders_the_waiting_requests_under_the_priority_policy():
    async def main():
        servicer, engine = _servicer("priority")
        engine.start()
        finished: list[str] = []

        async def generate(request: generate_pb2.GenerateRequest) -> None:
            async for msg in servicer.Generate(request, None):
                if msg.HasField("finish_reason"):
                    finished.append(msg.request_id)

        # "running" holds the one seat; "late" arrives before "urgent" but has a higher value.
        first = servicer.Generate(_request("running", 40), None)
        await first.__anext__()
        waiting = [asyncio.create_task(generate(_request("late", 4, priority=5)))]
        while engine.stats.num_waiting < 1:
            await asyncio.sleep(0.001)
        waiting.append(asyncio.create_task(generate(_request("urgent", 4, priority=-3))))
        while engine.stats.num_waiting < 2:
            await asyncio.sleep(0.001)
        async for _ in first:
            pass
        await asyncio.gather(*waiting)
        assert finished == ["urgent", "late"]
        engine.shutdown()

    run(main())


def test_a_priority_without_the_priority_policy_is_refused_naming_the_field():
    async def main():
        servicer, engine = _servicer("fcfs")
        engine.start()
        with pytest.raises(InvalidRequestError) as e:
            await parse(_request("p", 4, priority=2), servicer._loaded())
        assert status_for(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert str(e.value).startswith("priority: 2") and "--policy priority" in str(e.value)
        assert engine.stats.num_steps == 0, "no worker call for a refused request"
        # Priority 0 (the default) is every request's under FCFS.
        streams = await servicer.admit(await parse(_request("q", 2), servicer._loaded()))
        assert [out.finish_reason async for out in streams[0]][-1] == "length"
        engine.shutdown()

    run(main())
