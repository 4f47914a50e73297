"""Client commands that cannot finish end with one line on stderr and a non-zero exit, never a
traceback: Ctrl-C mid-stream, no server at the address. A fake Generation server stands in for
the real one (no model is loaded here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from batchwire.v1 import generate_pb2, generate_pb2_grpc

from scheduler_svc.cli.client import GenerationClient, interrupt_cancels, with_default_port
from tests.client_api.server_process import REPO

CLI = [sys.executable, "-m", "scheduler_svc.cli"]


class _Stalling(generate_pb2_grpc.GenerationServicer):
    """Streams one piece of text, then waits until the client goes away."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        context.add_callback(self.cancelled.set)
        self.started.set()
        yield generate_pb2.GenerateResponse(text="Once upon")
        while context.is_active():
            time.sleep(0.05)


    def GetModelInfo(self, request, context):
        """Answers nothing until the client goes away."""
        context.add_callback(self.cancelled.set)
        self.started.set()
        while context.is_active():
            time.sleep(0.05)
        return generate_pb2.GetModelInfoResponse()


@pytest.fixture
def stalling_server():
    servicer = _Stalling()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_during_generate_cancels_and_prints_one_line(stalling_server):
    servicer, address = stalling_server
    process = subprocess.Popen([*CLI, "generate", "--address", address, "--raw", "Tell me a story"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert servicer.started.wait(60)
    first = process.stdout.read(len("Once upon"))  # Ctrl-C only once the client is streaming
    assert first == "Once upon", (first, process.stderr.read())
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err.strip().splitlines() == ["batchwire generate: interrupted"]
    assert out == "\n"  # the streamed line ended, and nothing more
    assert servicer.cancelled.wait(10), "the server never saw the stream cancelled"


def test_ctrl_c_while_asking_for_the_model_info_prints_one_line(stalling_server):
    servicer, address = stalling_server
    # Without --raw, generate first asks whether the model has a chat template.
    process = subprocess.Popen([*CLI, "generate", "--address", address, "Tell me a story"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert servicer.started.wait(60)  # the call is under way
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert err.strip().splitlines() == ["batchwire generate: interrupted"]
    assert servicer.cancelled.wait(10), "the server never saw the call cancelled"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_no_server_at_the_address_is_one_line(command):
    address = f"127.0.0.1:{_free_port()}"
    # chat waits for the server before its first prompt: 1 s of its 10 s default is enough for
    # nobody to answer at a free port.
    argv = [*CLI, command, "--address", address] + (
        ["Hi"] if command == "generate" else ["--connect-timeout", "1"])
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                          input="Hi\n")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 + (command == "chat"), done.stderr  # chat greets first
    assert lines[-1].startswith(f"batchwire {command}: cannot reach a server at {address}")


def test_an_address_without_a_port_means_the_default_port():
    assert with_default_port("localhost") == "localhost:50051"
    assert with_default_port("10.0.0.7") == "10.0.0.7:50051"
    assert with_default_port("[::1]") == "[::1]:50051"
    assert with_default_port("::1") == "[::1]:50051"
    assert with_default_port("localhost:6000") == "localhost:6000"
    assert with_default_port("[::1]:6000") == "[::1]:6000"
    assert with_default_port("dns:///scheduler.svc:50051") == "dns:///scheduler.svc:50051"
    with GenerationClient("localhost") as client:
        assert client.address == "localhost:50051"


class _NoWorker(generate_pb2_grpc.GenerationServicer):
    """Refuses every request as the scheduler does when no worker replica is left."""

    def Generate(self, request, context):
        from scheduler_svc.engine.replicas import NO_WORKER, NoReplicaError
        from scheduler_svc.service.status_codes import status_for

        context.abort(*status_for(NoReplicaError(NO_WORKER)))


def test_no_worker_says_unavailable_once_and_why():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    generate_pb2_grpc.add_GenerationServicer_to_server(_NoWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = subprocess.run([*CLI, "generate", "--address", f"127.0.0.1:{port}", "--raw", "Hi"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        server.stop(0)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "batchwire generate: UNAVAILABLE: no worker is available to run the request: none has "
        "joined yet, or every one failed or is leaving"), done.stderr


def test_a_ctrl_c_while_a_call_is_being_made_cancels_it_once_it_exists():
    """The signal lands while gRPC's Python code makes the call (the server may have it already):
    nothing is raised inside that code; the call is cancelled once it exists, and
    KeyboardInterrupt comes when the block ends."""

    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    call, reached = Call(), False
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the run started in the background
    with pytest.raises(KeyboardInterrupt):
        with interrupt_cancels() as watch:
            os.kill(os.getpid(), signal.SIGINT)  # as if inside stub.GetModelInfo.future(...)
            time.sleep(0.01)  # the handler runs here, in the main thread: it must not raise
            assert not call.cancelled
            watch(call)
            reached = True
    assert reached and call.cancelled
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was
