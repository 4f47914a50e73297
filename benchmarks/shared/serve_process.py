"""`batchwire serve` (or `scheduler`) in a process group of its own on a free loopback port, for
the load generator; stop() kills the whole group (the server and any worker it started)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServeProcess:
    def __init__(self, *serve_args: str, startup_timeout_s: float = 300.0,
                 command: str = "serve", wait_serving: bool = True) -> None:
        """wait_serving=False returns once the port is bound (a scheduler serves only once a
        worker has registered with it: wait_serving() then)."""
        folder = Path(tempfile.mkdtemp(prefix="bw-bench-serve-"))
        ready, self.log_path = folder / "ready.json", folder / "server.log"
        self.startup_timeout_s = startup_timeout_s
        cmd = [sys.executable, "-m", "scheduler_svc.cli", command, "--host", "127.0.0.1",
               "--port", "0", "--metrics-port", "0", "--http-port", "0", "--ready-file",
               str(ready), "--no-progress",
               *serve_args]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            self.address = self._wait_bound(ready, time.monotonic() + startup_timeout_s)
            if wait_serving:
                self.wait_serving()
        except BaseException:
            self.stop()
            raise

    def _wait_bound(self, ready: Path, deadline: float) -> str:
        while not ready.exists():
            self._check(deadline)
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        self.http_port = info["http_port"]
        self.http_url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI-compatible API
        self.metrics_port = info["metrics_port"]
        return f"127.0.0.1:{info['port']}"

    def wait_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != serving:
                self._check(deadline)
                time.sleep(0.2)

    def _check(self, deadline: float) -> None:
        if self.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"batchwire serve did not come up; its log:\n"
                               f"{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
