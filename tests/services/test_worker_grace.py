"""`batchwire scheduler --worker-grace-s`: when the last worker dies or freezes, its requests wait
for a worker to register (a new one, or the frozen one back from SIGCONT) and resume on it with
the tokens of an undisturbed run, no gap and no duplicate; health says NOT_SERVING meanwhile. With
nobody back they fail with UNAVAILABLE after about the grace period, and so do the new requests
that waited with them (bounded by the queue limit). One scheduler process, two registering
workers, the tiny model."""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time

import grpc
import pytest
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from tests.deploy.processes import Process

from .conftest import WORKER_ARGS, WorkerProcess, scheduler_config
from .test_registration import wait_until

GRACE_S = 4.0
HEARTBEAT_S = 0.4  # a frozen worker is noticed after about three periods
MAX_QUEUED = 7
NUM_REQUESTS = 6
MAX_TOKENS = 120
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Sampling values exact in float32, so that the wire's floats are the reference's.
SEEDED = dict(temperature=0.75, top_p=0.875, frequency_penalty=0.5, presence_penalty=0.25,
              repetition_penalty=1.25)


def workload(round_: int) -> list[tuple[list[int], dict]]:
    """Even requests greedy, odd ones seeded with penalties (their tokens depend on the output
    so far and on the generator's position: a resumed request must carry both)."""
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [(11 * i + 7 * j + round_) % 500 + 1 for j in range(5 + 6 * i)]
        fields = dict(max_tokens=MAX_TOKENS - 5 * i, ignore_eos=True)
        fields.update(temperature=0) if i % 2 == 0 else fields.update(SEEDED, seed=100 * round_ + i)
        requests.append((prompt, fields))
    return requests


@pytest.fixture(scope="module")
def served_model(tiny_llama, default_tokenizer, tmp_path_factory) -> str:
    """The tiny model with a tokenizer, which a scheduler process needs."""
    folder = tmp_path_factory.mktemp("tiny-served") / "model"
    shutil.copytree(tiny_llama, folder)
    default_tokenizer.save_pretrained(folder)
    return str(folder)


def reference(model: str, requests) -> list[list[int]]:
    """Each request's tokens from an undisturbed in-process engine."""
    engine = EngineCore(scheduler_config(model))
    for i, (prompt, fields) in enumerate(requests):
        engine.add_request(prompt, SamplingParams(**fields), request_id=str(i))
    tokens: dict[str, list[int]] = {}
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.shutdown()
    return [tokens[str(i)] for i in range(len(requests))]


class Stream(threading.Thread):
    """One Generate call read to its end: tokens, message times, the last message or error."""

    def __init__(self, stub, request_id: str, prompt: list[int], fields: dict) -> None:
        super().__init__(daemon=True)
        self.request = generate_pb2.GenerateRequest(
            request_id=request_id, token_ids=prompt, sampling=generate_pb2.SamplingParams(**fields))
        self.stub = stub
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.last: generate_pb2.GenerateResponse | None = None
        self.error: grpc.RpcError | None = None
        self.ended = 0.0
        self.start()

    def run(self) -> None:
        try:
            for message in self.stub.Generate(self.request, timeout=120):
                self.tokens.extend(message.token_ids)
                self.times.append(time.monotonic())
                self.last = message
        except grpc.RpcError as e:
            self.error = e
        self.ended = time.monotonic()


def test_last_worker_lost_requests_wait_for_one_and_resume(served_model, tmp_path):
    ready = tmp_path / "scheduler.ready.json"
    scheduler = Process(
        [sys.executable, "-m", "scheduler_svc.cli", "scheduler", "--model", served_model,
         *WORKER_ARGS[:6], "--max-num-seqs", "16", "--max-model-len", "512",
         "--max-num-batched-tokens", "512", "--transport", "zmq", "--host", "127.0.0.1",
         "--port", "0", "--no-metrics", "--no-http", "--ready-file", str(ready), "--no-progress",
         "--worker-grace-s", str(GRACE_S), "--worker-heartbeat-s", str(HEARTBEAT_S),
         "--max-queued-requests", str(MAX_QUEUED), "--log-level", "WARNING"],
        ready, tmp_path / "scheduler.log", env={"OMP_NUM_THREADS": "1"})
    workers: list[WorkerProcess] = []
    try:
        address = f"127.0.0.1:{scheduler.wait_ready()['port']}"
        workers = [WorkerProcess(served_model, tmp_path, "--scheduler-address", address)
                   for _ in range(2)]
        rounds = [workload(r) for r in range(3)]
        expected = [reference(served_model, requests) for requests in rounds]  # meanwhile
        first, second = (w.wait_ready() for w in workers)
        channel = grpc.insecure_channel(address)
        stub = generate_pb2_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status

        def live_workers() -> int:
            info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
            return sum(w.state == generate_pb2.WORKER_STATE_READY for w in info.workers)

        def waiting() -> int:  # requests waiting for a worker count as waiting
            return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(),
                                      timeout=10).num_waiting_requests

        wait_until(lambda: status() == SERVING and live_workers() == 2, 120, "both registered",
              scheduler)
        second.signal(signal.SIGSTOP)  # frozen and dropped: the first is the last worker
        wait_until(lambda: live_workers() == 1, 10, "the frozen worker dropped", scheduler)

        def start(round_: int) -> list[Stream]:
            streams = [Stream(stub, f"r{round_}-{i}", prompt, fields)
                       for i, (prompt, fields) in enumerate(rounds[round_])]
            wait_until(lambda: all(s.tokens for s in streams), 60, "every stream started",
                       scheduler)
            return streams

        def check(streams: list[Stream], round_: int, resumed: float) -> None:
            for s in streams:
                s.join(timeout=120)
                assert s.error is None, (s.request.request_id, s.error)
            assert [s.tokens for s in streams] == expected[round_]  # no gap, no duplicate
            assert {s.last.finish_reason for s in streams} == {"length"}
            assert [s.last.usage.completion_tokens for s in streams] == [
                len(t) for t in expected[round_]]
            # They did wait and go on: no worker could compute a token between the loss and the
            # moment the test let one run again, and every stream still had tokens to come then
            # (none had finished when the loss was seen), so each one's later tokens came after.
            assert all(s.times[-1] > resumed for s in streams)

        # 1. The last worker killed mid-stream; a worker registers within the grace period (the
        # frozen one, thawed: it registers again as a new replica).
        streams = start(0)
        first.signal(signal.SIGKILL)
        wait_until(lambda: status() == NOT_SERVING, 10, "NOT_SERVING with no worker", scheduler)
        assert not any(s.last.finish_reason for s in streams), "finished before the kill"
        prompt, fields = rounds[0][0]  # greedy: a new request waits, then runs as any other
        new = Stream(stub, "new-0", prompt, fields)
        wait_until(lambda: waiting() == NUM_REQUESTS + 1, 10, "the new request waits too",
                   scheduler)
        second.signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(lambda: status() == SERVING, 2 * GRACE_S, "SERVING once it registered",
                   scheduler)
        check(streams, 0, resumed)
        new.join(timeout=60)
        assert new.error is None and new.tokens == expected[0][0], new.error

        # 2. The last worker frozen mid-stream (SIGSTOP), thawed within the grace period.
        streams = start(1)
        second.signal(signal.SIGSTOP)
        wait_until(lambda: status() == NOT_SERVING, 10, "the frozen worker noticed", scheduler)
        assert not any(s.last.finish_reason for s in streams), "finished before the freeze"
        second.signal(signal.SIGCONT)
        check(streams, 1, time.monotonic())

        # 3. The last worker killed and nobody comes back: in-flight and new requests wait for
        # about the grace period, up to the queue limit, then fail with UNAVAILABLE.
        streams = start(2)
        second.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: status() == NOT_SERVING, 10, "NOT_SERVING with no worker", scheduler)
        new = Stream(stub, "new", [1, 2, 3], dict(temperature=0, max_tokens=4))
        wait_until(lambda: waiting() == MAX_QUEUED, 10, "the queue full", scheduler)
        with pytest.raises(grpc.RpcError) as full:  # 6 + 1 wait: the limit
            list(stub.Generate(generate_pb2.GenerateRequest(token_ids=[1, 2], sampling=dict(
                max_tokens=2)), timeout=10))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value
        for s in [*streams, new]:
            s.join(timeout=3 * GRACE_S)
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
            # Not before the grace period, and not long after.
            assert 0.9 <= (s.ended - killed) / GRACE_S <= 1.6, s.ended - killed
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:  # the grace period is over: at once
            list(stub.Generate(new.request, timeout=10))
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 1.0
        channel.close()
    finally:
        for w in workers:
            w.kill()
        scheduler.stop(grace_s=5)
