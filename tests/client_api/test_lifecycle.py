"""A server's life on its own process: NOT_SERVING while loading, SERVING after, a full queue
refused at admission, and SIGTERM draining the requests in flight before the process exits."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import openai
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import (
    NOT_SERVING,
    SERVING,
    ServerProcess,
    collect,
    greedy,
    text_request,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """One request runs at a time and one more may wait."""
    process = ServerProcess(tmp_path_factory.mktemp("lifecycle"), "--max-num-seqs", "1",
                            "--max-queued-requests", "1")
    yield process
    process.stop()


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_health_is_serving_only_once_loaded(small_server):
    # The port is bound (and the ready file written) before the model loads.
    assert small_server.health_status() == NOT_SERVING
    small_server.wait_serving()
    assert small_server.health_status("batchwire.v1.Generation") == SERVING


def test_full_queue_refused_at_admission_then_sigterm_drains(small_server):
    small_server.wait_serving()
    running = small_server.stub.Generate(
        text_request("Tell me a story.", greedy(200), request_id="long"), timeout=300)
    next(running)  # it runs, holding the only running slot
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(result=collect(
        small_server.stub.Generate(text_request("Hi", greedy(4)), timeout=300))))
    waiter.start()
    _wait_for(lambda: small_server.server_info().num_waiting_requests == 1, 30, "a waiting request")

    with pytest.raises(grpc.RpcError) as e:
        list(small_server.stub.Generate(text_request("Hi", greedy(4)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The HTTP API refuses it too, as OpenAI's rate limit (429), through the same admission.
    http = openai.OpenAI(base_url=small_server.base_url, api_key="-", max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        http.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=4)
    assert limited.value.body["code"] == "queue_full"

    small_server.process.send_signal(signal.SIGTERM)
    _wait_for(lambda: small_server.health_status() == NOT_SERVING, 10, "NOT_SERVING")
    assert small_server.server_info().draining
    with pytest.raises(grpc.RpcError) as e:
        list(small_server.stub.Generate(text_request("Hi", greedy(4)), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.InternalServerError) as draining:
        http.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=4)
    assert draining.value.status_code == 503
    with pytest.raises(openai.InternalServerError) as health:  # /health: 503, and why
        http.get(small_server.base_url.removesuffix("/v1") + "/health", cast_to=object)
    assert "the server is stopping" in health.value.body["message"]

    # The running request goes on streaming while the server drains; it is aborted here only to
    # keep the test short. The waiting one is admitted and runs to its end.
    assert next(running).token_ids
    small_server.stub.Abort(generate_pb2.AbortRequest(request_ids=["long"]), timeout=10)
    *_, last = running
    assert last.finish_reason == "abort"
    waiter.join(timeout=120)
    _, _, queued_last, _ = queued["result"]
    assert queued_last.finish_reason == "length" and queued_last.usage.completion_tokens == 4
    assert small_server.process.wait(timeout=60) == 0
