"""Hostile bodies to the HTTP front answer 4xx with OpenAI's error object, never 5xx: integers
too large for the message, text no encoder takes (lone surrogates, bytes that are not UTF-8),
values of the wrong JSON type, NaN and Infinity, deep nesting, bodies over --max-request-bytes
(413, before the body is read whole) and /tokenize and /detokenize past max_model_len. After
them the server answers a greedy request exactly as before."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterable

import pytest

pytestmark = pytest.mark.slow

LIMIT = 1 << 20  # the default --max-request-bytes of the session server (max_model_len 256)
GREEDY = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def send(server, path: str, body: bytes | Iterable[bytes], chunked: bool = False
         ) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"},
                     encode_chunked=chunked)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, None


def post(server, path: str, payload: object) -> tuple[int, dict | None]:
    return send(server, path, json.dumps(payload).encode())


def refused(status: int, reply: dict | None, expected_status: int = 400) -> dict:
    assert status == expected_status, (status, reply)
    assert reply is not None and set(reply["error"]) >= {"message", "type", "param", "code"}
    assert reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    return reply["error"]


def greedy_text(server) -> str:
    status, reply = post(server, "/v1/completions", GREEDY)
    assert status == 200, reply
    return reply["choices"][0]["text"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (path, body as JSON text, the param the 400 names)
CASES = [
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "priority": {2**80}}}', "priority"),
    ("/v1/completions", f'{{"prompt": [{10**12}], "max_tokens": 2}}', "prompt[0]"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "seed": {2**70}}}', "seed"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": "10"}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2.0}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1e308}}',
     "logit_bias.5"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": -101}}',
     "logit_bias.5"),
    ("/detokenize", f'{{"tokens": [{2**40}]}}', "tokens[0]"),
    ("/v1/completions", '{"max_tokens": 1, "prompt": [' + '"hi", ' * 2048 + '"hi"]}', "prompt"),
    # 1e400 parses as infinity: refused before the admission or the worker sees it.
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e400}',
     "repetition_penalty"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"logit_bias": {"5": -1e400}}', "logit_bias.5"),
    ("/v1/responses", '{"input": "a\\ud800"}', "input"),
    ("/v1/responses", f'{{"input": "hi", "max_output_tokens": {2**80}}}', "max_output_tokens"),
    ("/v1/responses", '{"input": [{"type": "function_call", "name": "f"}]}', "input[0].call_id"),
    ("/v1/responses", '{"input": "hi", "previous_response_id": "resp_x"}',
     "previous_response_id"),
    ("/v1/responses", '{"input": "hi", "tools": [{"type": "function", "name": "f"}, '
     '{"type": "function", "name": "f"}]}', "tools[1].name"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[c[2] + c[0] for c in CASES])
def test_values_no_message_can_hold_are_400_naming_the_field(server, path, body, param):
    server.wait_serving()
    error = refused(*send(server, path, body.encode()))
    assert error["param"] == param, error


# Bodies refused as a whole: (body bytes, words the message holds)
BODIES = [
    (b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "not UTF-8"),
    (b'{"prompt": "\xff", "max_tokens": 2}', "not UTF-8"),
    (b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": Infinity}}', "Infinity is not JSON"),
    (b'{"prompt": "hi", "temperature": NaN}', "NaN is not JSON"),
    (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "the body is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"prompt": "hi", "response_format": ' + b'{"a": ' * 100 + b"1" + b"}" * 101,
     "nested more than 64"),
    (b'{"prompt": "hi", "max_tokens": 2', "the body is not valid JSON: Expecting ',' delimiter "
     "at line 1, column 33 (character 32)"),
]


@pytest.mark.parametrize(("body", "words"), BODIES, ids=[w for _, w in BODIES])
def test_bodies_that_are_not_text_or_json_are_400(server, body, words):
    server.wait_serving()
    error = refused(*send(server, "/v1/completions", body))
    assert words in error["message"], error


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    server.wait_serving()
    ids = b"[" + b"1," * (LIMIT // 2) + b"1]"
    body = b'{"max_tokens": 2, "prompt": ' + ids + b"}"
    refused(*send(server, "/v1/completions", body), expected_status=413)
    # Declared larger than what the server drops unread: refused on the header alone.
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(100 << 20))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413
    assert "--max-request-bytes" in json.loads(response.read())["error"]["message"]
    conn.close()
    # Chunked, with no length declared: refused once the bytes read pass the limit.
    chunks = (body[i:i + 65536] for i in range(0, len(body), 65536))
    status, reply = send(server, "/v1/completions", chunks, chunked=True)
    error = refused(status, reply, 413)
    assert f"limit of {LIMIT} bytes" in error["message"]


def test_tokenize_and_detokenize_are_bounded_by_max_model_len(server):
    server.wait_serving()
    started = time.monotonic()
    error = refused(*post(server, "/tokenize", {"prompt": "a" * 500_000}))
    assert error["param"] == "prompt" and "max_model_len=256" in error["message"]
    assert time.monotonic() - started < 10  # refused on its characters, never tokenized
    error = refused(*post(server, "/tokenize", {"prompt": "hello " * 300}))
    assert error["param"] == "prompt" and "more than max_model_len=256" in error["message"]
    error = refused(*post(server, "/tokenize", {"messages": [
        {"role": "user", "content": "hello " * 300}]}))
    assert error["param"] == "messages", error
    error = refused(*post(server, "/detokenize", {"tokens": [1] * 257}))
    assert error["param"] == "tokens" and "max_model_len=256" in error["message"]
    status, reply = post(server, "/tokenize", {"prompt": "hello " * 100})
    assert status == 200 and reply["count"] <= 256
    status, reply = post(server, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and reply["prompt"].startswith("hello hello")


def test_the_server_answers_alike_after_hostile_bodies(server):
    server.wait_serving()
    before = greedy_text(server)
    for path, body, _ in CASES:
        send(server, path, body.encode())
    for body, _ in BODIES:
        send(server, "/v1/completions", body)
    assert greedy_text(server) == before
