"""The grace period in the replicated engine, on fake workers: requests of a failed last replica
and new ones wait for a replica, resume on the one that joins with the tokens of an undisturbed
run, and fail with UNAVAILABLE after the grace period; aborts, the queue limit and ids in use
while they wait."""

from __future__ import annotations

import time

import grpc
import pytest

from scheduler_svc.core.errors import QueueFullError, RequestIdInUseError
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.commands import AddRequest
from scheduler_svc.engine.replicas import NoReplicaError, ReplicatedEngine
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.executors.uni import UniProcExecutor

from .conftest import make_config
from .fake_worker import FakeWorker

PROMPTS = [[(7 * i + 3 * j) % 60 + 2 for j in range(5 + 7 * i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


class FailingExecutor(UniProcExecutor):
    """A fake worker group that a test can fail, as a dead worker's executor latches."""

    def __init__(self, config) -> None:
        super().__init__(config, FakeWorker(256, 16, vocab_size=64, max_model_len=1024))
        self.down = False

    @property
    def failed(self) -> bool:
        return self.down

    def collective_rpc(self, method, *args, **kwargs):
        if self.down and method != "shutdown":
            raise WorkerUnavailableError("the worker is gone")
        return super().collective_rpc(method, *args, **kwargs)


def engine_with(grace_s: float, **config) -> tuple[ReplicatedEngine, FailingExecutor]:
    cfg = make_config(block_size=16, worker_grace_s=grace_s, **config)
    executor = FailingExecutor(cfg)
    return ReplicatedEngine(cfg, [executor]), executor


def collect(engine: ReplicatedEngine, tokens: dict[str, list[int]], until=None) -> None:
    while engine.has_requests() and (until is None or not until()):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def undisturbed() -> dict[str, list[int]]:
    engine, _ = engine_with(0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, PARAMS, request_id=f"r{i}")
    engine.add_request(PROMPTS[0], PARAMS, request_id="new")
    tokens: dict[str, list[int]] = {}
    collect(engine, tokens)
    return tokens


def test_requests_wait_for_a_replica_and_resume_unchanged():
    engine, first = engine_with(30)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, PARAMS, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    for _ in range(5):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(0 < len(t) < 20 for t in tokens.values())
    first.down = True
    assert engine.step() == []  # no replica: they wait, nothing fails
    assert not engine.replicas and len(engine.parked) == 3
    new = AddRequest("new", PROMPTS[0], PARAMS)
    engine.inbox.put(new)
    engine.step()
    assert not new.admitted.done()  # it waits too
    with pytest.raises(RequestIdInUseError):  # a waiting request's id is in use
        engine.add_request(PROMPTS[1], PARAMS, request_id="r1")

    joined = engine.attach(FailingExecutor(engine.config))
    collect(engine, tokens)
    assert joined.result(0) and new.admitted.result(0) is None
    assert tokens == undisturbed()  # no gap, no duplicate, the same tokens
    assert engine.num_moved == 3 and not engine.parked


def test_waiting_requests_fail_after_the_grace_period():
    grace_s = 1.0  # long beside a step, so that "not long after" holds on a loaded machine
    engine, first = engine_with(grace_s, max_queued_requests=3)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(prompt, PARAMS, request_id=f"r{i}")
    engine.step()
    first.down = True
    lost = time.monotonic()
    engine.step()
    new, over = AddRequest("new", PROMPTS[0], PARAMS), AddRequest("over", PROMPTS[0], PARAMS)
    engine.inbox.put(new)
    engine.inbox.put(over)
    engine.step()
    assert isinstance(over.admitted.exception(0), QueueFullError)  # r0, r1, new: the limit
    assert engine.abort_requests(["r1"])[0].finish_reason == "abort"  # it ends at once

    with pytest.raises(NoReplicaError) as info:
        while True:
            engine.step()
    waited = time.monotonic() - lost
    assert info.value.request_ids == ["r0"]
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert isinstance(new.admitted.exception(0), NoReplicaError)
    assert 1.0 <= waited / grace_s < 2.0, waited
    assert not engine.has_requests()
    late = AddRequest("late", PROMPTS[0], PARAMS)  # after the grace period: refused at once
    engine.inbox.put(late)
    engine.step()
    assert isinstance(late.admitted.exception(0), NoReplicaError)


def test_without_a_grace_period_requests_fail_at_once():
    engine, first = engine_with(0)
    engine.add_request(PROMPTS[0], PARAMS, request_id="r0")
    engine.step()
    first.down = True
    with pytest.raises(NoReplicaError) as info:
        engine.step()
    assert info.value.request_ids == ["r0"] and not engine.parked
    assert engine.idle_wait_s() is None  # nothing to watch: the loop sleeps until woken


def test_a_stop_string_ends_a_waiting_request_at_once():
    """The output processor may find a stop string in text the engine already sent after the
    request's replica died: the request waits for a replica then, and must end now, not at the
    end of the grace period."""
    engine, first = engine_with(30)
    engine.add_request(PROMPTS[0], PARAMS, request_id="r0")
    got = sum((len(out.new_token_ids) for _ in range(3) for out in engine.step()), 0)
    first.down = True
    engine.step()
    assert "r0" in engine.parked
    (out,) = engine.stop_requests({"r0": (got, "stop here")})
    assert (out.finished, out.finish_reason, out.stop_reason) == (True, "stop", "stop here")
    assert out.num_output_tokens == got and "r0" not in engine.parked
    assert not engine.has_requests()
