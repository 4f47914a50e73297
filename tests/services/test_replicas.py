"""Data-parallel replicas on real worker processes: placement across replicas, a replica killed
mid-generation (its requests, greedy and seeded with penalties, move and finish with the
undisturbed tokens, no gap, no duplicate),
the last one killed (UNAVAILABLE, never a hang), and a worker that registers under load and then
leaves on SIGTERM."""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
import time

import grpc
import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.replicas import NoReplicaError, ReplicatedEngine
from scheduler_svc.executors.replies import reply_ready
from scheduler_svc.service.registry import WorkerRegistryServicer, add_registry_to_server

from .conftest import scheduler_config

NUM_REQUESTS = 8
WORKLOAD = [([(13 * i + 5 * j) % 500 + 1 for j in range(6 + 7 * i)], 40 + 5 * i)
            for i in range(NUM_REQUESTS)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mixed(i: int, max_tokens: int) -> SamplingParams:
    """Even requests greedy; odd ones seeded random sampling with every penalty, whose tokens
    depend on the output so far and on the generator's position: a move must carry both."""
    if i % 2 == 0:
        return greedy(max_tokens)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                          ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.3,
                          repetition_penalty=1.2)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    """Each request's tokens from an undisturbed in-process engine."""
    engine = EngineCore(scheduler_config(tiny_llama))
    for i, (prompt, max_tokens) in enumerate(WORKLOAD):
        engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.shutdown()
    return tokens


def start_workers(start_worker, n: int, *extra: str):
    workers = [start_worker(*extra, wait=False) for _ in range(n)]
    return [w.wait_ready() for w in workers]


class Streams:
    """What each client has seen: the concatenated deltas, and whether it finished."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str | None] = {}
        self.counts: dict[str, int] = {}

    def take(self, outputs) -> None:
        for out in outputs:
            assert out.request_id not in self.finished, f"{out.request_id}: output after the end"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.counts[out.request_id] = out.num_output_tokens
            if out.finished:
                self.finished[out.request_id] = out.finish_reason

    def until_every_request_runs(self, engine, also=lambda: True, timeout_s: float = 60.0):
        """Steps until each of the workload's requests has tokens (and also() holds), then
        checks none has finished: every request is mid-generation. A replicated engine's
        step() makes only the calls whose worker replies are in, so a fixed number of step()
        calls is not a fixed number of model steps."""
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < NUM_REQUESTS or not also():
            assert time.monotonic() < deadline, "the requests did not all start"
            self.take(engine.step())
        assert all(0 < len(t) < 40 for t in self.tokens.values()) and not self.finished
        return self


def test_replicas_share_the_load_with_the_same_tokens(start_worker, tiny_llama, reference):
    workers = start_workers(start_worker, 2)
    config = scheduler_config(tiny_llama, "zmq", tuple(w.address("zmq") for w in workers))
    engine = ReplicatedEngine(config)
    try:
        for i, (prompt, max_tokens) in enumerate(WORKLOAD):
            engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
        assert [r.load for r in engine.replicas] == [NUM_REQUESTS // 2] * 2
        streams = Streams()
        while engine.has_requests():
            streams.take(engine.step())
        assert streams.tokens == reference
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend, async_scheduling",
                         [("zmq", False), ("grpc", False), ("zmq", True), ("grpc", True)],
                         ids=["zmq", "grpc", "zmq-async", "grpc-async"])
def test_killed_replica_requests_move_and_finish_unchanged(backend, async_scheduling,
                                                           start_worker, tiny_llama, reference):
    workers = start_workers(start_worker, 2)
    config = scheduler_config(tiny_llama, backend, tuple(w.address(backend) for w in workers),
                              async_scheduling=async_scheduling)
    engine = ReplicatedEngine(config)
    try:
        for i, (prompt, max_tokens) in enumerate(WORKLOAD):
            engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
        streams = Streams()
        # The kill lands between two steps with nothing awaited: under async scheduling the
        # dead replica holds a sampled step whose tokens are applied while the next one is
        # launched, which is where a token could be applied and never delivered.
        doomed = engine.replicas[1]
        streams.until_every_request_runs(engine, also=lambda: doomed.launched is None)
        reply = doomed.awaited_reply()
        assert reply is None or reply_ready(reply, timeout_s=10)
        workers[1].signal(signal.SIGKILL, rank=0)
        workers[1].wait_gone(rank=0)
        launch_fails_while_tokens_apply(doomed.core)
        start = time.monotonic()
        while len(engine.replicas) == 2:
            streams.take(engine.step())
            assert time.monotonic() - start < 10, "the dead replica was not noticed"
        assert engine.num_moved == NUM_REQUESTS // 2
        while engine.has_requests():
            streams.take(engine.step())
        assert streams.tokens == reference  # no gap, no duplicate, the same tokens
        assert set(streams.finished.values()) == {"length"}
        assert streams.counts == {r: len(t) for r, t in reference.items()}
    finally:
        engine.shutdown()


def launch_fails_while_tokens_apply(core: EngineCore) -> None:
    """Makes certain the order a race gives now and then: the step launched to a dead worker
    has failed by the time the step before's tokens are applied (they must still reach the
    client)."""
    launch, apply = core.launch_step, core.apply_in_flight
    launched = []

    def launch_step():
        launched.append(launch())
        return launched[-1]

    def apply_in_flight():
        outputs = apply()
        if launched[-1] is not None:
            assert reply_ready(launched[-1].forward, timeout_s=10)
        return outputs

    core.launch_step, core.apply_in_flight = launch_step, apply_in_flight


def test_last_replica_killed_fails_its_requests_with_unavailable(start_worker, tiny_llama):
    worker = start_worker()
    engine = ReplicatedEngine(scheduler_config(tiny_llama, "zmq", (worker.address("zmq"),)))
    try:
        for i, (prompt, max_tokens) in enumerate(WORKLOAD[:3]):
            engine.add_request(prompt, greedy(max_tokens), request_id=f"r{i}")
        engine.step()
        worker.signal(signal.SIGKILL, rank=0)
        start = time.monotonic()
        with pytest.raises(NoReplicaError) as info:
            while True:
                engine.step()
        assert time.monotonic() - start < 10
        assert sorted(info.value.request_ids) == ["r0", "r1", "r2"]
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert not engine.has_requests()
        with pytest.raises(NoReplicaError):
            engine.add_request([1, 2, 3], greedy(4), request_id="late")
    finally:
        engine.shutdown()


class EngineThread:
    """The engine on a thread of its own, as a server runs it: requests in through a queue."""

    def __init__(self, engine: ReplicatedEngine) -> None:
        self.engine = engine
        self.streams = Streams()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.placed: dict[str, str] = {}  # client id -> the replica it was first placed on
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while not self.inbox.empty():
                    client_id, prompt, params = self.inbox.get()
                    self.engine.add_request(prompt, params, request_id=client_id)
                    self.placed[client_id] = self.engine._replica_of(client_id).replica_id
                if self.engine.has_requests():
                    self.streams.take(self.engine.step())
                else:
                    time.sleep(0.005)
        except BaseException as e:
            self.error = e

    def wait_for(self, condition, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.error is None, self.error
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture()
def registry(tiny_llama):
    """A scheduler with one listed replica and a WorkerRegistry on a free port, its engine and
    registry server each on a thread of their own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    started = []

    def start(first_worker) -> tuple[EngineThread, str]:
        config = scheduler_config(tiny_llama, "zmq", (first_worker.address("zmq"),))
        engine = ReplicatedEngine(config)

        async def serve() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            add_registry_to_server(WorkerRegistryServicer(engine, config), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        server, port = asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
        driver = EngineThread(engine)
        started.append((driver, server))
        return driver, f"127.0.0.1:{port}"

    yield start
    for driver, server in started:
        driver.stop()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        driver.engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)


def test_worker_joins_under_load_and_leaves_on_sigterm(start_worker, registry, reference):
    first = start_worker()
    driver, address = registry(first)
    engine = driver.engine
    for i, (prompt, max_tokens) in enumerate(WORKLOAD[:4]):
        driver.inbox.put((f"r{i}", prompt, mixed(i, max_tokens)))
    driver.wait_for(lambda: len(driver.streams.tokens) == 4)

    second = start_worker("--scheduler-address", address)  # registers once serving
    driver.wait_for(lambda: len(engine.replicas) == 2, timeout_s=30)
    first_id, newcomer = (r.replica_id for r in engine.replicas)
    for i in range(4, NUM_REQUESTS):
        prompt, max_tokens = WORKLOAD[i]
        driver.inbox.put((f"r{i}", prompt, mixed(i, max_tokens)))
    driver.wait_for(lambda: len(driver.placed) == NUM_REQUESTS)
    # The newcomer is the least loaded (or tied, behind the first): it takes requests at once.
    assert sum(r == newcomer for r in driver.placed.values()) >= 2

    second.signal(signal.SIGTERM, rank=0)  # leaves: its requests finish there or move
    assert second.process.wait(timeout=60) == 0
    assert [r.replica_id for r in engine.replicas] == [first_id]
    driver.wait_for(lambda: len(driver.streams.finished) == NUM_REQUESTS)
    assert driver.streams.tokens == reference
