"""Ctrl-C on a server with requests in flight, as a person at a terminal meets it: the first
says how to stop now and drains for a time a person waits (30 s with a terminal on stdin); the
second cuts the streams off with an error the clients read: gRPC UNAVAILABLE, and on HTTP an
error event then `data: [DONE]`."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time

import grpc
import pytest

from tests.client_api.server_process import ServerProcess, greedy, text_request

pytestmark = pytest.mark.slow

MAX_TOKENS = 900  # far more than a step or two between the signals can make


def _wait_for_log(server: ServerProcess, text: str) -> str:
    deadline = time.monotonic() + 30
    while text not in server.log():
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, f"the log never said {text!r}:\n{server.log()}"
        time.sleep(0.05)
    return server.log()


def _sse_stream(server: ServerProcess) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a story.", "stream": True,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    return response


def _next_event(response: http.client.HTTPResponse) -> str:
    while True:
        line = response.readline().decode()
        assert line, "the stream ended"
        if line.startswith("data: "):
            return line.removeprefix("data: ").strip()


def test_ctrl_c_says_how_to_stop_now_and_the_second_ends_streams_with_an_error(tmp_path):
    controller, terminal = os.openpty()  # stdin is a terminal, as for a person running `make run`
    server = ServerProcess(tmp_path, "--max-model-len", "1024", "--kv-cache-memory", "192M",
                           stdin=terminal)
    try:
        server.wait_serving()
        streaming = server.stub.Generate(
            text_request("Tell me a story.", greedy(MAX_TOKENS)), timeout=300)
        assert next(streaming).token_ids
        sse = _sse_stream(server)
        assert json.loads(_next_event(sse))["choices"]

        server.process.send_signal(signal.SIGINT)
        log = _wait_for_log(server, "waiting up to 30 s for 2 requests in flight to finish "
                                    "(press Ctrl-C again to stop now)")
        assert "waiting for 2 requests" not in log
        # Draining: both go on streaming.
        assert next(streaming).token_ids
        assert json.loads(_next_event(sse))["choices"]

        server.process.send_signal(signal.SIGINT)
        with pytest.raises(grpc.RpcError) as cut:
            for _ in streaming:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the server is stopping" in cut.value.details()

        events = []
        while (line := sse.readline().decode()):
            if line.startswith("data: "):
                events.append(line.removeprefix("data: ").strip())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "the server is stopping" in error["message"]
        assert error["code"] == "service_unavailable"
        assert server.process.wait(timeout=60) == 1
        assert "second SIGINT: stopping now, ending 2 requests" in server.log()
    finally:
        server.stop()
        os.close(terminal)
        os.close(controller)
