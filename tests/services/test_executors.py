"""The scheduler's executors against real worker processes: the same tokens whatever the
transport, a worker group started by the executor itself, and failures that surface within
seconds, never a hang."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import WorkerError, WorkerUnavailableError
from scheduler_svc.executors.grpc_executor import GrpcExecutor
from scheduler_svc.executors.zmq_executor import ZmqExecutor

from .conftest import WireClient, scheduler_config

EXECUTORS = {"grpc": GrpcExecutor, "zmq": ZmqExecutor}

# (prompt, max_tokens): prompts of 3..120 tokens; the longest spans several blocks and, with the
# prefill threshold below, several steps.
WORKLOAD = [([(17 * i + 3 * j) % 500 + 1 for j in range(n)], m)
            for i, (n, m) in enumerate([(3, 20), (40, 12), (120, 9), (17, 30), (64, 5), (9, 25)])]


def run_workload(engine: EngineCore, workload=WORKLOAD) -> dict[str, list[int]]:
    for i, (prompt, max_tokens) in enumerate(workload):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True), request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def uni_tokens(tiny_llama) -> dict[str, list[int]]:
    config = scheduler_config(tiny_llama, long_prefill_token_threshold=48)
    engine = EngineCore(config)
    try:
        return run_workload(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["grpc", "zmq"])
def test_same_tokens_in_process_and_over_the_wire(backend, async_scheduling, shared_worker,
                                                   tiny_llama, uni_tokens):
    config = scheduler_config(tiny_llama, backend, (shared_worker.address(backend),),
                              long_prefill_token_threshold=48, async_scheduling=async_scheduling)
    assert Executor.get_class(config) is EXECUTORS[backend]
    engine = EngineCore(config)
    try:
        assert run_workload(engine) == uni_tokens
        assert [len(uni_tokens[f"r{i}"]) for i in range(len(WORKLOAD))] == [m for _, m in WORKLOAD]
    finally:
        engine.shutdown()


def test_executor_starts_and_stops_its_own_worker_group(tiny_llama, uni_tokens):
    config = scheduler_config(tiny_llama, "zmq", long_prefill_token_threshold=48)
    engine = EngineCore(config)
    group = engine.executor.group
    assert group is not None
    try:
        # Its loopback ports answer only the random token the executor holds.
        for transport in ("grpc", "zmq"):
            stranger = WireClient(transport, group.addresses(transport)[0])
            code, message = stranger.call("Shutdown", b"")
            stranger.close()
            assert code == grpc.StatusCode.UNAUTHENTICATED, (transport, code, message)
        assert run_workload(engine) == uni_tokens
    finally:
        engine.shutdown()
    assert group.process.wait(timeout=15) == 0  # a clean exit after the Shutdown call
    assert not os.path.exists(group.folder)  # its token file is not left in /tmp


def test_refused_step_surfaces_from_the_future_and_the_executor_lives_on(shared_worker, tiny_llama):
    from batchwire.v1 import worker_pb2 as pb

    config = scheduler_config(tiny_llama, "zmq", (shared_worker.address("zmq"),))
    executor = ZmqExecutor(config)
    try:
        bad = pb.SchedulerOutput(total_num_scheduled_tokens=3)  # nothing adds up to 3
        future = executor.execute_model(bad, non_block=True)
        with pytest.raises(WorkerError, match="INVALID_ARGUMENT") as info:
            future.result()
        assert not isinstance(info.value, WorkerUnavailableError)
        assert not executor.failed
        assert executor.get_info().vocab_size == 512
    finally:
        executor.shutdown()


def long_workload() -> list[tuple[list[int], int]]:
    return [([(31 * i + j) % 500 + 1 for j in range(12)], 400) for i in range(4)]


@pytest.mark.parametrize("backend", ["grpc", "zmq"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_dead_or_silent_worker_fails_the_executor_within_seconds(backend, sig, start_worker,
                                                                 tiny_llama):
    worker = start_worker()
    config = scheduler_config(tiny_llama, backend, (worker.address(backend),))
    engine = EngineCore(config)
    try:
        for i, (prompt, max_tokens) in enumerate(long_workload()):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True), request_id=f"r{i}")
        for _ in range(3):
            engine.step()
        worker.signal(sig, rank=0)
        start = time.monotonic()
        with pytest.raises(WorkerUnavailableError):
            for _ in range(10_000):  # mid-generation: the steps go on until one fails
                engine.step()
        assert time.monotonic() - start < 5.0
        assert engine.executor.failed
        start = time.monotonic()
        with pytest.raises(WorkerUnavailableError):
            engine.executor.execute_model(engine.scheduler.schedule())
        assert time.monotonic() - start < 0.1  # at once, not after another timeout
    finally:
        if sig == signal.SIGSTOP:
            worker.signal(signal.SIGCONT, rank=0)
        engine.shutdown()


@pytest.mark.parametrize("backend", ["grpc", "zmq"])
def test_tensor_parallel_group_gives_the_same_tokens(backend, start_worker, tiny_llama, uni_tokens):
    """`python -m worker_svc --tensor-parallel-size 2` starts both ranks; every step goes to
    both, rank 0 answers."""
    group = start_worker("--tensor-parallel-size", "2")
    assert [r["rank"] for r in group.ranks] == [0, 1]
    config = scheduler_config(tiny_llama, backend, (group.group_address(backend),),
                              long_prefill_token_threshold=48)
    engine = EngineCore(config)
    try:
        assert [i.rank for i in engine.executor.infos] == [0, 1]
        assert run_workload(engine) == uni_tokens
    finally:
        engine.shutdown()
    group.signal(signal.SIGTERM, rank=None)
    assert group.process.wait(timeout=20) == 0
