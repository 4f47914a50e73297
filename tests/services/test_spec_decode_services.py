"""Speculative decoding against real worker processes on the tiny model: the tokens of an
undisturbed in-process engine without speculation, greedy and seeded with penalties, over
grpc and zmq, on a tensor-parallel pair, and for requests moved off a killed replica (with
async scheduling too)."""

from __future__ import annotations

import signal
import time

import pytest

from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.replicas import ReplicatedEngine

from .conftest import scheduler_config
from .test_replicas import NUM_REQUESTS, WORKLOAD, Streams, mixed, reference, start_workers

__all__ = ["reference"]  # the fixture: each request's tokens without speculation, in-process
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)


def run(engine) -> Streams:
    streams = Streams()
    while engine.has_requests():
        streams.take(engine.step())
    return streams


def add_workload(engine) -> None:
    for i, (prompt, max_tokens) in enumerate(WORKLOAD):
        engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")


def accepted(engine) -> tuple[int, int]:
    replicas = ([r.core for r in engine.replicas] if isinstance(engine, ReplicatedEngine)
                else [engine])
    return (sum(r.scheduler.stats.num_accepted_tokens for r in replicas),
            sum(r.scheduler.stats.num_draft_tokens for r in replicas))


@pytest.mark.parametrize("backend, tp", [("grpc", 1), ("zmq", 1), ("zmq", 2)])
def test_same_tokens_as_without_speculation(backend, tp, shared_worker, start_worker, tiny_llama,
                                            reference):
    # One worker serves both transports: the TP=1 cases share the module's (one start, not two).
    group = shared_worker if tp == 1 else start_worker("--tensor-parallel-size", str(tp))
    engine = EngineCore(scheduler_config(tiny_llama, backend, (group.group_address(backend),),
                                         long_prefill_token_threshold=48, **SPEC))
    try:
        add_workload(engine)
        assert run(engine).tokens == reference
        num_accepted, num_drafted = accepted(engine)
        print(f"{backend} TP={tp}: {num_accepted}/{num_drafted} drafts accepted")
        assert num_accepted > 0 and num_drafted > num_accepted  # some kept, some rejected
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_moved_requests_keep_their_tokens(async_scheduling, start_worker, tiny_llama, reference):
    workers = start_workers(start_worker, 2)
    engine = ReplicatedEngine(scheduler_config(
        tiny_llama, "zmq", tuple(w.address("zmq") for w in workers),
        async_scheduling=async_scheduling, **SPEC))
    try:
        add_workload(engine)
        # Every request mid-generation, some drafts verified.
        streams = Streams().until_every_request_runs(engine, also=lambda: accepted(engine)[1] > 0)
        workers[1].signal(signal.SIGKILL, rank=0)
        start = time.monotonic()
        while len(engine.replicas) == 2:
            streams.take(engine.step())
            assert time.monotonic() - start < 10, "the dead replica was not noticed"
        assert engine.num_moved == NUM_REQUESTS // 2
        rest = run(engine)
        for r, t in rest.tokens.items():
            streams.tokens.setdefault(r, []).extend(t)
        assert streams.tokens == reference
        kv = engine.replicas[0].core.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1
    finally:
        engine.shutdown()
