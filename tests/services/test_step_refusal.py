"""A real worker's refusal of a step is per request, in process and over gRPC and ZMQ: a request
that got past admission (a test hook sets repetition_penalty=inf on its admitted params) is
refused by the worker, which names it; only it fails, the step goes again without it, and the 16
requests beside it (and a twin that found its prompt blocks in the prefix cache in the same step)
finish with the tokens of an undisturbed run. The worker's persistent batch stays consistent:
every later step is accepted, and a request after them is served."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore

from .conftest import scheduler_config

PROMPTS = {f"s{i}": [(13 * i + 5 * j) % 500 + 1 for j in range(3 + 7 * i % 40)]
           for i in range(16)}
SHARED_PROMPT = [(7 * j) % 500 + 3 for j in range(40)]  # two full blocks of 16, then 8
BAD_AT_STEP = 3  # the 16 are running (some still prefilling) when the refused one arrives


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(engine: EngineCore, with_bad: bool) -> tuple[dict[str, list[int]], list]:
    for req_id, prompt in PROMPTS.items():
        engine.add_request(prompt, _params(), request_id=req_id)
    tokens: dict[str, list[int]] = {}
    finals = []
    step = 0
    while engine.has_requests():
        step += 1
        if step == BAD_AT_STEP:
            if with_bad:
                bad = engine.add_request(SHARED_PROMPT, _params(), request_id="bad")
                bad.sampling_params.repetition_penalty = math.inf  # admission bypassed
            engine.add_request(SHARED_PROMPT, _params(), request_id="twin")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals.append(out)
    engine.add_request([4, 5, 6, 7], _params(), request_id="after")
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, finals


@pytest.fixture(scope="module")
def undisturbed(tiny_llama) -> dict[str, list[int]]:
    engine = EngineCore(scheduler_config(tiny_llama, max_num_seqs=20))
    try:
        return run(engine, with_bad=False)[0]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["uni", "grpc", "zmq"])
def test_only_the_refused_request_fails(backend, shared_worker, tiny_llama, undisturbed):
    addresses = () if backend == "uni" else (shared_worker.address(backend),)
    engine = EngineCore(scheduler_config(tiny_llama, backend, addresses, max_num_seqs=20))
    try:
        tokens, finals = run(engine, with_bad=True)
        scheduler = engine.scheduler
        assert scheduler.stats.num_refused_requests == 1
        assert scheduler.get_num_unfinished_requests() == 0
        assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks - 1
    finally:
        engine.shutdown()
    (bad,) = [out for out in finals if out.request_id == "bad"]
    assert bad.finish_reason == "abort" and bad.new_token_ids == []
    assert bad.error is not None and "sampling.repetition_penalty=inf" in bad.error
    assert "bad" not in tokens or tokens["bad"] == []
    assert {r: t for r, t in tokens.items() if r != "bad"} == undisturbed
    assert [len(undisturbed[r]) for r in PROMPTS] == [8] * 16
