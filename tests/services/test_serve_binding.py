"""Where `batchwire serve` listens before it loads anything: loopback unless --host says
otherwise, for the client, HTTP and metrics ports alike. The ready file is written once the
ports are bound, so the process is stopped before the model has loaded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.client_api.server_process import REPO

CLI = [sys.executable, "-m", "scheduler_svc.cli"]
LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


class BoundServe:
    """`batchwire serve` up to the moment its ports are bound (its ready file is written)."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None,
                 argv: list[str] | None = None) -> None:
        self.ready_file = tmp / "ready.json"
        self.log_path = tmp / "serve.log"
        # The host comes from this test alone, not from whoever runs it.
        inherited = {k: v for k, v in os.environ.items() if k != "BATCHWIRE_HOST"}
        argv = argv or [*CLI, "serve", "--no-progress", "--ready-file", str(self.ready_file),
                        *args]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**inherited, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while not self.ready_file.exists():
            assert self.process.poll() is None, f"serve exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"serve bound nothing in 120 s:\n{self.log()}"
            time.sleep(0.05)
        self.ports = json.loads(self.ready_file.read_text())

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def _address(hex_address: str) -> str:
    """/proc/net/tcp's hex address (32-bit words in host order, little-endian here) as text;
    an IPv4-mapped IPv6 address as its IPv4 form."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1]
                   for i in range(0, len(hex_address), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening_addresses(pid: int, port: int) -> set[str]:
    """The local addresses a process listens on at `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != LISTEN:
                continue
            found.add(_address(address))
    return found


def test_serve_binds_loopback_unless_told_otherwise(tmp_path):
    serve = BoundServe(tmp_path, "--port", "0", "--metrics-port", "0", "--http-port", "0")
    try:
        for name in ("port", "http_port", "metrics_port"):
            port = serve.ports[name]
            assert listening_addresses(serve.process.pid, port) == {"127.0.0.1"}, name
    finally:
        serve.stop()


def test_host_every_interface_when_asked_in_the_environment(tmp_path):
    serve = BoundServe(tmp_path, "--port", "0", "--metrics-port", "0", "--http-port", "0",
                       env={"BATCHWIRE_HOST": "0.0.0.0"})
    try:
        for name in ("port", "http_port", "metrics_port"):
            port = serve.ports[name]
            # gRPC takes 0.0.0.0 as every interface of both families: "::", dual-stack.
            addresses = listening_addresses(serve.process.pid, port)
            assert addresses and addresses <= {"0.0.0.0", "::"}, (name, addresses)
    finally:
        serve.stop()


@pytest.fixture
def default_side_ports():
    """Holds HTTP 8000 and metrics 9090, the defaults, where nothing else does already."""
    held = []
    for port in (8000, 9090):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:  # busy already: just as good for the test
            s.close()
    yield
    for s in held:
        s.close()


def test_make_run_serves_busy_side_ports_elsewhere_and_says_so(tmp_path, default_side_ports):
    stamp = tmp_path / "stamp"
    stamp.touch()  # newer than pyproject.toml: make skips the setup
    # ARGS reaches `batchwire serve`: a free client port and the ready file of this test.
    args = f"--port 0 --no-progress --ready-file {tmp_path / 'ready.json'}"
    serve = BoundServe(tmp_path, argv=["make", "-s", f"RUN_STAMP={stamp}", f"PY={sys.executable}",
                                       "run", f"ARGS={args}"])
    try:
        assert serve.ports["http_port"] not in (None, 8000)
        assert serve.ports["metrics_port"] not in (None, 9090)
        log = serve.log()
        assert (f"the HTTP port 8000 on 127.0.0.1 is in use: serving HTTP on port "
                f"{serve.ports['http_port']} instead") in log, log
        assert (f"the metrics port 9090 on 127.0.0.1 is in use: serving metrics on port "
                f"{serve.ports['metrics_port']} instead") in log, log
        assert ".venv/bin/batchwire serve --help" in log  # a command that works as printed
    finally:
        serve.stop()


def test_without_the_fallback_a_busy_side_port_still_stops_serve(tmp_path, default_side_ports):
    done = subprocess.run([*CLI, "serve", "--port", "0", "--metrics-port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "the HTTP port 8000 on 127.0.0.1 is already in use" in done.stderr, done.stderr
