"""The async engine loop on the fake worker (no model): streams, aborts, admission refusals, and a
worker failure, each ending with the status a client would get. Fast; no server process."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from scheduler_svc import SamplingParams
from scheduler_svc.core.errors import InvalidRequestError, QueueFullError
from scheduler_svc.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    NotAdmittingError,
    RequestIdInUseError,
)
from scheduler_svc.engine.replicas import NoReplicaError
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.service.server import ServerConfig
from scheduler_svc.service.status_codes import NotReadyError, status_for
from tests.scheduler.conftest import make_fake_engine
from tests.scheduler.fake_worker import fake_greedy

VOCAB = 64
PROMPT = [5, 6, 7, 8, 9]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class SlowWorker:
    """The fake worker taking a little time per step, so that a test can act mid-stream; it can
    be told to fail like a worker process that died."""

    def __init__(self, worker, step_s: float = 0.005) -> None:
        self.worker = worker
        self.step_s = step_s
        self.fail = False

    def execute_model(self, so):
        if self.fail:
            raise WorkerUnavailableError("the worker is gone")
        time.sleep(self.step_s)
        return self.worker.execute_model(so)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def _engine(max_queued_requests: int = 100, max_num_seqs: int = 16
            ) -> tuple[AsyncEngine, SlowWorker]:
    core, worker = make_fake_engine(num_blocks=64, block_size=4, vocab_size=VOCAB,
                                    max_queued_requests=max_queued_requests,
                                    max_num_seqs=max_num_seqs, max_model_len=128)
    slow = SlowWorker(worker)
    core.executor.worker = slow
    return AsyncEngine(core), slow


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _drain(stream) -> tuple[list[int], str | None]:
    ids, reason = [], None
    async for out in stream:
        ids += out.new_token_ids
        reason = out.finish_reason
    return ids, reason


async def _wait(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_streams_the_tokens_and_finishes():
    async def main():
        engine, _ = _engine()
        engine.start()
        stream = await engine.add_request("a", PROMPT, _params(6))
        ids, reason = await _drain(stream)
        assert ids == fake_greedy(PROMPT, 6, VOCAB) and reason == "length"
        assert engine.num_active == 0
        await _wait(lambda: engine.stats.kv_blocks_used == 0)
        engine.shutdown()

    run(main())


def test_a_duplicate_active_id_is_refused_until_it_finishes():
    async def main():
        engine, _ = _engine()
        engine.start()
        stream = await engine.add_request("dup", PROMPT, _params(20))
        with pytest.raises(RequestIdInUseError):
            await engine.add_request("dup", PROMPT, _params(2))
        await _drain(stream)
        await _drain(await engine.add_request("dup", PROMPT, _params(2)))
        engine.shutdown()

    run(main())


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks():
    async def main():
        engine, worker = _engine()
        engine.start()
        stream = await engine.add_request("gone", PROMPT, _params(50))
        await stream.__anext__()
        assert engine.stats.kv_blocks_used > 0
        stream.close()  # what the servicer does when the client cancels
        await _wait(lambda: engine.stats.kv_blocks_used == 0 and not worker.requests)
        assert engine.num_active == 0
        engine.shutdown()

    run(main())


def test_abort_by_id_ends_the_stream_with_abort():
    async def main():
        engine, _ = _engine()
        engine.start()
        stream = await engine.add_request("x", PROMPT, _params(50))
        await stream.__anext__()
        assert engine.abort(["x", "unknown"]) == ["x"]
        ids, reason = await _drain(stream)
        assert reason == "abort" and len(ids) < 49
        engine.shutdown()

    run(main())


def test_admission_refusals():
    async def main():
        engine, _ = _engine(max_queued_requests=1, max_num_seqs=1)
        engine.start()
        running = await engine.add_request("r", PROMPT, _params(40))
        await running.__anext__()  # running: the only slot is taken
        waiting = await engine.add_request("w", PROMPT, _params(2))
        with pytest.raises(QueueFullError):
            await engine.add_request("full", PROMPT, _params(2))
        with pytest.raises(InvalidRequestError):  # the scheduler's own validation
            await engine.add_request("bad", [VOCAB + 1], _params(2))
        engine.stop_admitting()
        with pytest.raises(NotAdmittingError):
            await engine.add_request("late", PROMPT, _params(2))
        # Draining: what was admitted still runs to its end.
        assert (await _drain(waiting))[1] == "length"
        assert (await _drain(running))[1] == "length"
        await asyncio.wait_for(engine.wait_until_idle(), 5)
        engine.shutdown()

    run(main())


def test_a_failed_worker_ends_every_stream_and_refuses_new_requests():
    # The engine is a replicated one even over one worker group: when that group fails its
    # requests end with UNAVAILABLE, and so do new ones until a group joins; the engine lives.
    async def main():
        engine, worker = _engine()
        died = []
        engine.on_dead = died.append
        engine.start()
        streams = [await engine.add_request(f"s{i}", PROMPT, _params(50)) for i in range(3)]
        await streams[0].__anext__()
        worker.fail = True
        for stream in streams:
            with pytest.raises(WorkerUnavailableError):
                await _drain(stream)
        assert engine.num_active == 0 and not died and engine.dead is None
        with pytest.raises(NoReplicaError):
            await engine.add_request("after", PROMPT, _params(2))
        engine.shutdown()

    run(main())


def test_an_engine_error_ends_every_stream_and_refuses_new_requests():
    async def main():
        engine, worker = _engine()
        died = []
        engine.on_dead = died.append
        engine.start()
        streams = [await engine.add_request(f"s{i}", PROMPT, _params(50)) for i in range(3)]
        await streams[0].__anext__()

        def broken(so):
            raise RuntimeError("a bug in the engine")

        worker.execute_model = broken
        for stream in streams:
            with pytest.raises(EngineDeadError):
                await _drain(stream)
        assert died and engine.num_active == 0
        with pytest.raises(EngineDeadError):
            await engine.add_request("after", PROMPT, _params(2))
        engine.shutdown()

    run(main())


def test_a_lost_replica_fails_only_its_requests():
    async def main():
        engine, _ = _engine()
        core = engine.core
        real_step = core.step
        lost = {}

        def step():
            outputs = real_step()
            if not lost and engine.num_active == 2:
                victim = "lost"  # what ReplicatedEngine.step raises when its replica failed
                core.abort_requests([victim])
                lost["key"] = victim
                raise NoReplicaError("no worker replica left", [victim],
                                     [o for o in outputs if o.request_id != victim])
            return outputs

        core.step = step
        engine.start()
        kept = await engine.add_request("kept", PROMPT, _params(8))
        gone = await engine.add_request("lost", PROMPT, _params(8))
        with pytest.raises(WorkerUnavailableError):
            await _drain(gone)
        ids, reason = await _drain(kept)
        assert reason == "length" and len(ids) == 8 and engine.dead is None
        engine.shutdown()

    run(main())


@pytest.mark.parametrize(("error", "code"), [
    (InvalidRequestError("sampling.top_p", "2 must be in (0, 1]"),
     grpc.StatusCode.INVALID_ARGUMENT),
    (RequestIdInUseError("x"), grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReadyError("loading"), grpc.StatusCode.UNAVAILABLE),
    (NotAdmittingError("draining"), grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError("dead"), grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailableError("gone"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
])
def test_each_error_has_one_status_code(error, code):
    assert status_for(error)[0] == code


def test_server_options_accept_client_pings_every_30_s_and_age_connections():
    options = dict(ServerConfig().grpc_options())
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 30_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.max_connection_age_ms"] > 0
    assert options["grpc.max_connection_age_grace_ms"] > 0
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"]
    assert options["grpc.so_reuseport"] == 0
