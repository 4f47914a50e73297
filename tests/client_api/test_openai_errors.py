"""Errors of the HTTP API as the `openai` SDK raises them: 400 naming the field with no engine
step run, 404 for an unknown model or route, 401 for a missing or wrong key (the gRPC API's key
file), 503 while no worker serves. The queue-full 429 and the draining 503 are in
test_lifecycle.py, on its one-slot server."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import openai
import pytest

from tests.client_api.test_openai_sdk import HELLO, MODEL, client  # noqa: F401 (fixture)
from tests.deploy.processes import Process

pytestmark = pytest.mark.slow

LONG = "word " * 300


VLLM_FIELDS = ("stop_token_ids", "priority")
# (what the request sets, the field the 400 names)
CHAT_CASES = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ({"seed": -1}, "seed"),
    ({"logit_bias": {"fifty": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
    ({"n": 1000}, "n"),
    ({"stop_token_ids": [-5]}, "stop_token_ids"),
    ({"priority": 3}, "priority"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "nope"}}}},
     "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}, "messages"),
    ({"messages": "hello"}, "messages"),
]


def test_bad_fields_are_400_naming_them_with_no_engine_step(server, client):  # noqa: F811
    server.wait_idle()  # every request before this test has ended: none can be admitted now
    before = server.scheduled_prompt_tokens()
    for fields, param in CHAT_CASES:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, **fields}
        extra = {k: body.pop(k) for k in VLLM_FIELDS if k in body}  # not the SDK's own
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body, extra_body=extra)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, (fields, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.message, fields
    for prompt, param in ((2**40, "prompt"), ([10**7], "prompt"), ([], "prompt")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == param, (prompt, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens 0 only with echo
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    assert server.scheduled_prompt_tokens() == before  # nothing reached the engine
    ok = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert ok.choices[0].message.content  # and the server serves on


def test_unknown_model_and_route_are_404(client):  # noqa: F811
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=HELLO, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(MODEL)  # /v1/models/{id} is not served
    assert e.value.status_code == 404 and e.value.body["message"]


@pytest.fixture(scope="module")
def keyed_scheduler(tmp_path_factory):
    """`batchwire scheduler` with an API key file and no worker: it never loads the model."""
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "keys").write_text("# rotated keys\nold-key\nnew-key\n")
    ready = tmp / "ready.json"
    process = Process(
        [sys.executable, "-m", "scheduler_svc.cli", "scheduler", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--http-port", "0", "--api-key-file",
         str(tmp / "keys"), "--ready-file", str(ready), "--no-progress"], ready, tmp / "log")
    try:
        yield f"http://127.0.0.1:{process.wait_ready()['http_port']}"
    finally:
        process.stop(grace_s=2)


def _status(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else {}


def test_keys_and_no_worker(keyed_scheduler):
    url = keyed_scheduler
    code, body = _status(f"{url}/health")  # open, and not serving: no worker yet
    assert code == 503 and body["error"]["type"] == "service_unavailable_error"
    assert "no worker has joined yet" in body["error"]["message"]
    code, body = _status(f"{url}/v1/models")
    assert code == 401 and "Authorization: Bearer" in body["error"]["message"]
    assert body["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=HELLO)
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="new-key", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        keyed.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable_error"


def test_https_with_the_grpc_ports_certificate(tmp_path):
    """With --tls-cert the HTTP API speaks TLS too, with the same certificate: no client API is
    left in plaintext."""
    import ssl

    from tests.deploy.certs import make_ca, make_cert

    ca = make_ca()
    (tmp_path / "ca.crt").write_bytes(ca.cert)
    cert, key = make_cert(ca, "scheduler", ("localhost", "127.0.0.1")).write(tmp_path, "server")
    ready = tmp_path / "ready.json"
    process = Process(
        [sys.executable, "-m", "scheduler_svc.cli", "scheduler", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--http-port", "0", "--tls-cert", cert,
         "--tls-key", key, "--ready-file", str(ready), "--no-progress"], ready, tmp_path / "log")
    try:
        port = process.wait_ready()["http_port"]
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with pytest.raises(urllib.error.HTTPError) as e:  # TLS up; no worker yet: 503
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10,
                                   context=context)
        assert e.value.code == 503
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext: refused
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        process.stop(grace_s=2)


def _post(url: str, data: bytes, content_type: str | None = "application/json"
          ) -> tuple[int, dict]:
    headers = {"Content-Type": content_type} if content_type else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_errors_say_what_to_change_in_http_words(server):
    url = server.base_url
    code, body = _post(f"{url}/embeddings", json.dumps({"model": MODEL, "input": "hi"}).encode())
    error = body["error"]
    assert code == 400 and error["param"] == "model" and error["code"] == "wrong_task"
    assert "'generate' model" in error["message"] and "--task embed" in error["message"]
    assert "/v1/completions" in error["message"]
    assert "Embed:" not in error["message"] and "use Generate" not in error["message"]

    code, body = _post(f"{url}/completions", b'{"model": "x", "prompt": "hi",}')
    assert code == 400 and body["error"]["message"] == (
        "the body is not valid JSON: Expecting property name enclosed in double quotes at "
        "line 1, column 31 (character 30)")
    # curl -d without -H sends a form's content type: FastAPI does not read it as JSON.
    code, body = _post(f"{url}/completions", b'{"model": "x", "prompt": "hi"}',
                       "application/x-www-form-urlencoded")
    assert code == 400 and body["error"]["message"] == (
        "the body is not read as JSON: it came as 'application/x-www-form-urlencoded'; send it "
        "with `Content-Type: application/json`")
