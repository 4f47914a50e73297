"""A real `batchwire serve` process on loopback, and factories for the requests tests send it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0  # model load on a busy 2-core machine
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# The default model in float32 (as the offline API runs it in the parity tests) on a small KV pool:
# 64 MiB holds 91 blocks of 16 tokens.
BASE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64M", "--max-model-len", "256",
             "--max-num-batched-tokens", "512")


class ServerProcess:
    """Starts the server in a process group of its own; stop() kills the whole group."""

    def __init__(self, tmp: Path, *extra_args: str, stdin: int | None = None) -> None:
        self.ready_file = tmp / "ready.json"
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        cmd = [sys.executable, "-m", "scheduler_svc.cli", "serve", *BASE_ARGS, "--host",
               "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "0",
               "--ready-file", str(self.ready_file), "--no-progress", *extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, stdin=stdin)
        info = self._wait_for_ready_file()
        self.port = info["port"]
        self.metrics_port = info["metrics_port"]
        self.http_port = info["http_port"]
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"  # the OpenAI API
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _wait_for_ready_file(self) -> dict:
        deadline = time.monotonic() + 60
        while not self.ready_file.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not bind in 60 s:\n{self.log()}")
            time.sleep(0.05)
        return json.loads(self.ready_file.read_text())

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")

    def health_status(self, service: str = "") -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return self.health.Check(request, timeout=10).status

    def wait_serving(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health_status() != SERVING:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not SERVING after {timeout_s:.0f} s:\n{self.log()}")
            time.sleep(0.2)

    def server_info(self) -> generate_pb2.GetServerInfoResponse:
        return self.stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)

    def wait_idle(self, timeout_s: float = 30.0) -> generate_pb2.GetServerInfoResponse:
        """Polls until no request runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.server_info()
            if not (info.kv_blocks_used or info.num_running_requests
                    or info.num_waiting_requests):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout_s:.0f} s: {info}")
            time.sleep(0.05)

    def scheduled_prompt_tokens(self) -> float:
        """Prompt tokens looked up in the prefix cache, which the scheduler does once for each
        request it admits to a step: only a request that reached the engine moves this count.
        (The step count is no such measure: the step that tells the worker an earlier request
        has finished comes after that request's stream ended and the server reported idle.)"""
        match = re.search(r"^batchwire_prefix_cache_queries_total (\S+)$", self.metrics(), re.M)
        assert match, "no prefix-cache query counter in /metrics"
        return float(match.group(1))

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        self._log.close()


def greedy(max_tokens: int, **fields) -> generate_pb2.SamplingParams:
    """Greedy sampling that runs exactly max_tokens tokens (EOS ignored), unless told otherwise."""
    fields.setdefault("ignore_eos", True)
    return generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, **fields)


def text_request(text: str, sampling: generate_pb2.SamplingParams | None = None,
                 **fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=text, sampling=sampling, **fields)


def collect(responses) -> tuple[list[int], str, generate_pb2.GenerateResponse, int]:
    """(token ids, text, last message, number of messages) of a whole stream."""
    ids: list[int] = []
    text: list[str] = []
    last = None
    count = 0
    for last in responses:
        ids.extend(last.token_ids)
        text.append(last.text)
        count += 1
    assert last is not None, "the stream sent nothing"
    return ids, "".join(text), last, count
