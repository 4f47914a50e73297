"""A scheduler, its workers and a client, each on a test host of its own (netns.py), started as
an operator would: the scheduler binds its host's address, each worker binds every interface and
advertises its host's address when it registers, the client dials the scheduler across the
bridge."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.deploy.processes import REPO
from tests.services.conftest import WORKER_ARGS

from .netns import Host

STARTUP_TIMEOUT_S = 120.0
# Every host has a network stack of its own, so the default ports are free on each: the workers
# can start with the scheduler's address before it is up (they retry registering).
SCHEDULER_PORT = 50051
# The scheduler's limits match the workers' (WORKER_ARGS): the two agree on the KV cache.
SCHEDULER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "8M", "--block-size", "16",
                  "--max-num-seqs", "16", "--max-model-len", "512",
                  "--max-num-batched-tokens", "512")


class HostProcess:
    """A service on a test host, with its log and the JSON its --ready-file got."""

    def __init__(self, host: Host, name: str, argv: list[str], folder: Path,
                 ready_file: Path, env: dict[str, str] | None = None) -> None:
        self.host, self.name, self.ready_file = host, name, ready_file
        self.log_path = folder / f"{name}.log"
        self.process = host.popen(argv, log=self.log_path, cwd=REPO,
                                  env={"OMP_NUM_THREADS": "1", **(env or {})})
        self.info: dict = {}

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log()}"
            time.sleep(0.05)
        self.info = json.loads(self.ready_file.read_text())
        return self.info

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def log(self) -> str:
        return self.log_text()[-5000:]


def start_scheduler(host: Host, model: str, folder: Path, *extra: str) -> HostProcess:
    ready = folder / "scheduler.ready.json"
    argv = [sys.executable, "-m", "scheduler_svc.cli", "scheduler", "--model", model,
            *SCHEDULER_ARGS, "--host", host.address, "--port", str(SCHEDULER_PORT), "--no-metrics",
            "--no-http",
            "--ready-file", str(ready), "--no-progress", "--log-level", "INFO", *extra]
    return HostProcess(host, "scheduler", argv, folder, ready)


def scheduler_address(host: Host) -> str:
    return f"{host.address}:{SCHEDULER_PORT}"


def start_worker(host: Host, model: str, folder: Path, scheduler_address: str,
                 *extra: str) -> HostProcess:
    name = f"worker-{host.address}"
    ready = folder / f"{name}.ready.json"
    argv = [sys.executable, "-m", "worker_svc", "--model", model, *WORKER_ARGS,
            "--host", "0.0.0.0", "--advertise-host", host.address, "--port", "50061",
            "--zmq-port", "50062", "--metrics-port", "9091", "--ready-file", str(ready),
            "--scheduler-address", scheduler_address, "--log-level", "INFO", *extra]
    return HostProcess(host, name, argv, folder, ready)


class Client:
    """The client host: requests run there by tests/hosts/client.py; status read from here."""

    def __init__(self, host: Host, address: str, tls_ca: str | None = None) -> None:
        self.host, self.address, self.tls_ca = host, address, tls_ca

    def start(self, requests: list[dict], ready_tokens: int = 1) -> subprocess.Popen:
        """Opens the streams; the process prints `streaming` once each has ready_tokens."""
        spec = dict(address=self.address, tls_ca=self.tls_ca, ready_tokens=ready_tokens,
                    requests=requests)
        return self.host.popen([sys.executable, "-m", "tests.hosts.client", json.dumps(spec)],
                               cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={"OMP_NUM_THREADS": "1"})

    @staticmethod
    def wait_streaming(process: subprocess.Popen) -> None:
        line = process.stdout.readline().strip()
        assert line == "streaming", f"the client said {line!r} (exit {process.poll()})"

    @staticmethod
    def results(process: subprocess.Popen, timeout_s: float = 120.0) -> dict[str, dict]:
        out, _ = process.communicate(timeout=timeout_s)
        assert process.returncode == 0, f"the client exited with {process.returncode}"
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return {r["id"]: r for r in results}

    def run(self, requests: list[dict]) -> dict[str, dict]:
        process = self.start(requests)
        self.wait_streaming(process)
        return self.results(process)

    def ready_workers(self) -> list[str]:
        """The addresses of the scheduler's READY workers, asked through GetServerInfo."""
        script = ("import sys, grpc\n"
                  "from batchwire.v1 import generate_pb2 as g, generate_pb2_grpc as gg\n"
                  "a, ca = sys.argv[1], sys.argv[2]\n"
                  "ch = (grpc.secure_channel(a, grpc.ssl_channel_credentials(open(ca, 'rb')"
                  ".read())) if ca else grpc.insecure_channel(a))\n"
                  "info = gg.GenerationStub(ch).GetServerInfo(g.GetServerInfoRequest(), "
                  "timeout=10)\n"
                  "print(' '.join(w.address for w in info.workers if w.state == g.WORKER_STATE_"
                  "READY))\n")
        out = self.host.run([sys.executable, "-c", script, self.address, self.tls_ca or ""])
        return out.stdout.split()

    def wait_ready_workers(self, count: int, timeout_s: float, scheduler: HostProcess
                           ) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(workers := self.ready_workers()) != count:
            assert scheduler.process.poll() is None, f"the scheduler exited:\n{scheduler.log()}"
            assert time.monotonic() < deadline, (
                f"{count} READY workers within {timeout_s:.0f} s, got {workers}:\n"
                f"{scheduler.log()}")
            time.sleep(0.1)
        return workers
