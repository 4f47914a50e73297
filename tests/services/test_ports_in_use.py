"""A port already in use ends a command with one line naming the port and the flag that moves
it, and a non-zero exit, for every port serve and worker open. Nothing is loaded: ports are
checked before the model."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.client_api.server_process import REPO

CLI = [sys.executable, "-m", "scheduler_svc.cli"]
FREE = "0"  # every other port: any free one

CASES = [
    ("serve", "gRPC", "--port", ["--metrics-port", FREE, "--http-port", FREE]),
    ("serve", "metrics", "--metrics-port", ["--port", FREE, "--http-port", FREE]),
    ("serve", "health", "--health-port", ["--port", FREE, "--metrics-port", FREE,
                                          "--http-port", FREE]),
    ("serve", "HTTP", "--http-port", ["--port", FREE, "--metrics-port", FREE]),
    ("worker", "worker gRPC", "--port", ["--zmq-port", FREE, "--metrics-port", FREE]),
    ("worker", "worker ZMQ", "--zmq-port", ["--port", FREE, "--metrics-port", FREE]),
    ("worker", "metrics", "--metrics-port", ["--port", FREE, "--zmq-port", FREE]),
    ("worker", "health", "--health-port", ["--port", FREE, "--zmq-port", FREE,
                                           "--metrics-port", FREE]),
]


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(("command", "what", "flag", "others"), CASES,
                         ids=[f"{c[0]} {c[2]}" for c in CASES])
def test_a_port_in_use_is_one_line_naming_the_flag(taken_port, command, what, flag, others):
    argv = [*CLI, command, "--host", "127.0.0.1", flag, str(taken_port), *others]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"batchwire {command}: the {what} port {taken_port} on 127.0.0.1 is already in use: "
        f"stop what holds it, or pick another with {flag} PORT (0 = any free port)"), lines[0]
