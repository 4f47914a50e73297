"""Long text prompts: one that cannot fit is refused before it is tokenized, and a long text
being tokenized does not hold up the other streams (a 10 MB prompt once stalled them 9.6 s:
the tokenizer ran on the event loop)."""

from __future__ import annotations

import threading
import time

import grpc
import openai
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import greedy, text_request

pytestmark = pytest.mark.slow


def test_a_text_too_long_to_fit_is_refused_at_once(server):
    info = server.stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=30)
    for request in (text_request("word " * 2_000_000),  # 10 MB
                    generate_pb2.GenerateRequest(messages=[generate_pb2.ChatMessage(
                        role="user", content="word " * 2_000_000)])):
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            list(server.stub.Generate(request, timeout=60))
        took = time.perf_counter() - t0
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "10000000 characters cannot fit max_model_len=" in e.value.details()
        assert str(info.limits.max_model_len) in e.value.details()
        assert took < 3, f"refused after {took:.1f} s: it was tokenized first"


def test_tokenizing_a_long_text_does_not_hold_up_other_streams(server):
    arrivals: list[float] = []
    started = threading.Event()

    # Longer than the test needs: it is cancelled once the tokenizing is done.
    call = server.stub.Generate(text_request("Count: one, two,", greedy(240)), timeout=120)

    def stream() -> None:
        try:
            for _ in call:
                arrivals.append(time.perf_counter())
                started.set()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    reply = server.stub.Tokenize(generate_pb2.TokenizeRequest(text="hello world. " * 150_000),
                                 timeout=120)  # ~2 MB: about a second of tokenizing here
    t1 = time.perf_counter()
    call.cancel()
    streamer.join()
    assert len(reply.token_ids) > 100_000
    during = [t for t in arrivals if t0 <= t <= t1]
    assert len(during) >= 2, f"the stream ended before the tokenizing ({t1 - t0:.2f} s) did"
    times = [t0, *during, t1]
    worst = max(b - a for a, b in zip(times, times[1:], strict=False))
    # On the event loop the stream would wait the whole tokenizing; off it, a step or two.
    assert worst < 0.5 * (t1 - t0), f"the stream waited {worst:.2f} s of {t1 - t0:.2f} s"


def test_the_http_front_refuses_a_text_too_long_to_fit_at_once(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    # Half a megabyte: under the body cap (at least 1 MiB), far over what 256 tokens can hold.
    text = "word " * 100_000
    for call in (
        lambda: client.completions.create(model=model, prompt=text, max_tokens=2),
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}]),
    ):
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert time.perf_counter() - t0 < 5
        assert "500000 characters cannot fit max_model_len" in str(e.value)
    # Ten megabytes is larger than any prompt that could fit: refused while the body arrives.
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="word " * 2_000_000, max_tokens=2)
    assert e.value.status_code == 413
    assert time.perf_counter() - t0 < 5
