"""Factories for service tests: a tiny random Llama checkpoint, worker processes on loopback
(each in its own process group, killed whole at teardown), wire clients for both transports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
import zmq

from scheduler_svc.config import SchedulerConfig

STARTUP_TIMEOUT_S = 90.0
SERVICE = "batchwire.v1.Worker"


# The worker's limits; scheduler_config() matches them.
LIMITS = dict(max_num_reqs=16, max_model_len=512, max_num_batched_tokens=512)
WORKER_ARGS = [
    "--dtype", "float32", "--kv-cache-memory", "8M", "--block-size", "16",
    "--max-num-reqs", "16", "--max-model-len", "512", "--max-num-batched-tokens", "512",
]


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """One torch thread here and in every worker these tests start. The tiny model gains nothing
    from two, and on a shared 2-core machine two-thread OpenMP regions stall whenever another
    process holds the other core, which made a run of these tests take ten times as long."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the worker processes
    yield
    torch.set_num_threads(threads)
    if env is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = env




def scheduler_config(model: str, backend: str = "uni", addresses: tuple[str, ...] = (),
                     **overrides) -> SchedulerConfig:
    fields = dict(model=model, dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=16,
                  max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512,
                  executor_backend=backend, worker_addresses=addresses, worker_heartbeat_s=0.5)
    return SchedulerConfig(**{**fields, **overrides})


class WorkerProcess:
    """`python -m worker_svc` on free loopback ports, in a process group of its own."""

    def __init__(self, model: str, directory, *extra: str) -> None:
        self.ready_file = os.path.join(directory, f"ready-{time.monotonic_ns()}.json")
        cmd = [sys.executable, "-m", "worker_svc", "--model", model, *WORKER_ARGS,
               "--host", "127.0.0.1", "--port", "0", "--zmq-port", "0", "--metrics-port", "0",
               "--ready-file", self.ready_file, "--log-level", "WARNING", *extra]
        self.process = subprocess.Popen(cmd, start_new_session=True)
        self.ranks: list[dict] = []

    def wait_ready(self) -> WorkerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not os.path.exists(self.ready_file):
            assert self.process.poll() is None, f"worker exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "worker not serving in time"
            time.sleep(0.05)
        with open(self.ready_file) as f:
            self.ranks = json.load(f)["ranks"]
        return self

    def address(self, transport: str, rank: int = 0) -> str:
        return f"127.0.0.1:{self.ranks[rank][f'{transport}_port']}"

    def group_address(self, transport: str) -> str:
        return ",".join(self.address(transport, r) for r in range(len(self.ranks)))

    def signal(self, sig: int, rank: int | None = None) -> None:
        """To one rank's process, or to the whole group."""
        if rank is None:
            os.killpg(self.process.pid, sig)
        else:
            os.kill(self.ranks[rank]["pid"], sig)

    def wait_gone(self, rank: int, timeout_s: float = 10.0) -> None:
        """Returns once a rank's process has exited (its sockets are closed)."""
        pid = self.ranks[rank]["pid"]
        if pid == self.process.pid:
            self.process.wait(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
            assert time.monotonic() < deadline, f"rank {rank} (pid {pid}) did not exit"
            time.sleep(0.01)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


@pytest.fixture()
def start_worker(tmp_path, tiny_llama):
    """start_worker(*extra_args, model=...) -> a serving WorkerProcess; all killed at teardown."""
    started: list[WorkerProcess] = []

    def start(*extra: str, model: str | None = None, wait: bool = True) -> WorkerProcess:
        worker = WorkerProcess(model or tiny_llama, tmp_path, *extra)
        started.append(worker)
        return worker.wait_ready() if wait else worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture(scope="module")
def shared_worker(tmp_path_factory, tiny_llama):
    """One worker for a whole module of tests that reset it before use."""
    worker = WorkerProcess(tiny_llama, tmp_path_factory.mktemp("shared-worker")).wait_ready()
    yield worker
    worker.kill()


class WireClient:
    """Raw calls on one transport: call(method, payload bytes) -> (status code, reply bytes).
    token: presented as the scheduler does (gRPC metadata, a third ZMQ frame)."""

    def __init__(self, transport: str, address: str, token: str | None = None) -> None:
        self.transport = transport
        self.token = token
        if transport == "grpc":
            self.channel = grpc.insecure_channel(address)
        else:
            self.socket = zmq.Context.instance().socket(zmq.DEALER)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.RCVTIMEO, 30_000)
            self.socket.connect(f"tcp://{address}")

    def call(self, method: str, payload: bytes) -> tuple[grpc.StatusCode, bytes]:
        if self.transport == "grpc":
            try:
                metadata = [("authorization", f"Bearer {self.token}")] if self.token else None
                reply = self.channel.unary_unary(f"/{SERVICE}/{method}")(
                    payload, timeout=30, metadata=metadata)
                return grpc.StatusCode.OK, reply
            except grpc.RpcError as e:
                return e.code(), (e.details() or "").encode()
        token = [self.token.encode()] if self.token else []
        return self.frames([method.encode(), payload, *token])

    def frames(self, frames: list[bytes]) -> tuple[grpc.StatusCode, bytes]:
        """ZMQ only: sends any frames; the reply must be [status byte, payload]."""
        self.socket.send_multipart(frames)
        status, payload = self.socket.recv_multipart()
        code = next(c for c in grpc.StatusCode if c.value[0] == status[0])
        return code, payload

    def close(self) -> None:
        if self.transport == "grpc":
            self.channel.close()
        else:
            self.socket.close()
