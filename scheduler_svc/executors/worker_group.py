"""A worker group started by the scheduler itself: `python -m worker_svc` as a child process.

Used when a remote executor is configured without worker addresses (one machine, or a test). The
child runs in its own session so that stopping the group also stops the ranks it started. Its
ports are on loopback, where any local user could reach them, so the group answers only the token
it is given (`token_file`), or a fresh random one written to a file only this user can read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from batchwire.common.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a model and allocating its cache, on a slow machine
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class RankEndpoint:
    rank: int
    host: str
    grpc_port: int
    zmq_port: int
    metrics_port: int | None = None  # its Prometheus /metrics (the overhead bench reads it)

    def address(self, transport: str) -> str:
        return f"{self.host}:{self.grpc_port if transport == 'grpc' else self.zmq_port}"


def _random_token(folder: str) -> str:
    """A fresh token in folder (mkdtemp's: this user's alone), in a file only this user reads."""
    path = os.path.join(folder, "worker-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def wait_ready(process: subprocess.Popen, ready: str, cmd: list[str],
               timeout_s: float = STARTUP_TIMEOUT_S) -> list[dict]:
    """The ranks a starting worker lists in its ready file, once it wrote it."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited with {process.returncode} while "
                               f"starting: {' '.join(cmd)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker was not serving after {timeout_s:.0f} s")
        time.sleep(_POLL_S)
    with open(ready) as f:
        return list(json.load(f)["ranks"])


class LocalWorkerGroup:
    def __init__(self, process: subprocess.Popen, endpoints: list[RankEndpoint],
                 token_file: str, folder: str) -> None:
        self.process = process
        self.endpoints = endpoints
        self.token_file = token_file  # the group answers only this file's token
        self.folder = folder  # its ready file and token: removed when the group stops

    @classmethod
    def start(cls, config: WorkerConfig, host: str = "127.0.0.1",
              timeout_s: float = STARTUP_TIMEOUT_S, extra_argv: tuple[str, ...] = (),
              token_file: str | None = None) -> LocalWorkerGroup:
        """Starts the group on free ports and returns once every rank is SERVING."""
        folder = tempfile.mkdtemp(prefix="batchwire-worker-")
        ready = os.path.join(folder, "ready.json")
        token_file = token_file or _random_token(folder)
        cmd = [sys.executable, "-m", "worker_svc", *config.to_argv(), "--host", host,
               "--port", "0", "--zmq-port", "0", "--metrics-port", "0", "--ready-file", ready,
               "--parent-pid", str(os.getpid()), "--worker-token-file", token_file,
               *extra_argv]
        if config.world_size == 1:
            cmd += ["--rank", "0"]
        process = subprocess.Popen(cmd, start_new_session=True)
        try:
            ranks = wait_ready(process, ready, cmd, timeout_s)
        except BaseException:
            _stop_session(process, grace_s=5.0)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        endpoints = [RankEndpoint(r["rank"], host, r["grpc_port"], r["zmq_port"],
                                  r.get("metrics_port")) for r in ranks]
        logger.info("started a local worker group: %s", endpoints)
        return cls(process, endpoints, token_file, folder)

    def addresses(self, transport: str) -> list[str]:
        return [e.address(transport) for e in self.endpoints]

    def stop(self, grace_s: float = 10.0, asked: bool = False) -> None:
        """`asked`: the group was told to shut down (a Shutdown call); it gets the grace period
        to exit on its own before any signal, which could land after its handlers are gone."""
        if asked:
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _stop_session(self.process, grace_s)
        shutil.rmtree(self.folder, ignore_errors=True)


def _stop_session(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the child's whole session, SIGKILL to what is left after the grace period."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
