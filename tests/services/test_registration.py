"""`batchwire scheduler` with no worker listed serves once a worker registers with it
(`python -m worker_svc --scheduler-address`), answers UNAVAILABLE when its only worker dies, and
serves again, with the same tokens, when another worker registers."""

from __future__ import annotations

import sys
import time

import grpc
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.client_api.server_process import BASE_ARGS, collect, greedy, text_request
from tests.deploy.processes import Process, worker

SERVING = health_pb2.HealthCheckResponse.SERVING
READY = generate_pb2.WORKER_STATE_READY
# The worker's limits match the scheduler's (BASE_ARGS) so the two agree on the KV cache.
WORKER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64M", "--max-model-len", "256",
               "--max-num-batched-tokens", "512", "--log-level", "WARNING")


def wait_until(predicate, timeout_s: float, what: str, process: Process) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert process.process.poll() is None, f"the scheduler exited:\n{process.log()}"
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s:\n{process.log()}"
        time.sleep(0.2)


def ready_workers(stub) -> int:
    info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
    return sum(w.state == READY for w in info.workers)


def test_workers_register_die_and_rejoin(tmp_path):
    ready = tmp_path / "scheduler.ready.json"
    scheduler = Process(
        [sys.executable, "-m", "scheduler_svc.cli", "scheduler", *BASE_ARGS, "--transport", "zmq",
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--no-http",
         "--ready-file", str(ready), "--no-progress"],
        ready, tmp_path / "scheduler.log", env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    workers: list[Process] = []
    try:
        port = scheduler.wait_ready()["port"]
        address = f"127.0.0.1:{port}"
        channel = grpc.insecure_channel(address)
        stub = generate_pb2_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING

        assert not serving(), "SERVING before any worker joined"

        def start_worker(name: str) -> Process:
            w = worker(tmp_path, name, *WORKER_ARGS, "--scheduler-address", address,
                       env={"OMP_NUM_THREADS": "1"})
            workers.append(w)
            w.wait_ready()
            return w

        first = start_worker("first")
        wait_until(serving, 240, "SERVING once a worker registered", scheduler)
        request = text_request("The capital of France is", greedy(8))
        tokens, _, last, _ = collect(stub.Generate(request, timeout=120))
        assert len(tokens) == 8 and last.finish_reason == "length"

        first.signal(9)  # SIGKILL: no goodbye
        first.process.wait()
        try:
            collect(stub.Generate(request, timeout=60))
            raise AssertionError("a request with no worker left did not fail")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert scheduler.process.poll() is None

        start_worker("second")
        wait_until(lambda: ready_workers(stub) == 1, 120, "the second worker joined", scheduler)
        again, _, last, _ = collect(stub.Generate(request, timeout=120))
        assert again == tokens and last.finish_reason == "length"
        channel.close()
    finally:
        for w in workers:
            w.stop(grace_s=2)
        scheduler.stop(grace_s=5)
