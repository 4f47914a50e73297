"""Servers of the tests as real processes on 127.0.0.1, each in a process group of its own that
stop() ends whole (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Process:
    def __init__(self, cmd: list[str], ready_file: Path, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.cmd, self.ready_file, self.log_path = cmd, ready_file, log
        self._log = open(log, "w")
        self.process = subprocess.Popen(
            cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.info: dict = {}

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.process.returncode}:\n"
                                   f"{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready in {timeout_s:.0f} s:\n{self.log()}")
            time.sleep(0.05)
        self.info = json.loads(self.ready_file.read_text())
        return self.info

    def log(self) -> str:
        if not self._log.closed:  # stop() closes it; the file stays readable
            self._log.flush()
        return self.log_path.read_text()[-5000:]

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 10.0) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # whatever the group still holds
        code = self.process.wait()
        self._log.close()
        return code


def worker(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> Process:
    """`python -m worker_svc` with the given options, on free loopback ports."""
    ready = tmp / f"{name}.ready.json"
    cmd = [sys.executable, "-m", "worker_svc", "--host", "127.0.0.1", "--port", "0",
           "--zmq-port", "0", "--metrics-port", "0", "--ready-file", str(ready), *args]
    return Process(cmd, ready, tmp / f"{name}.log", env)
