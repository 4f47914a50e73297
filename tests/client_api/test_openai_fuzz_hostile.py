"""Fuzzing the HTTP front with what an attacker sends, and after every example the server must
still answer a fixed greedy request with the same text; no answer is ever a 5xx, and every 4xx
is OpenAI's error object.

- schemathesis's stateful run over /openapi.json's links (/v1/models -> a completion with the
  listed model, /tokenize -> /detokenize and a completion of the tokens it returned);
- hypothesis strategies of our own: lone surrogates in any text field (JSON-escaped, and as
  raw bytes), integers far past int64, floats past a double, deep nesting, values of the wrong
  type, put into a valid request of each route.

Bounded: ~80 examples in all, valid requests capped at 3 tokens (see test_openai_fuzz.py for
schemathesis's plain positive and negative runs).
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

GREEDY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2, "min_tokens": 2}


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def greedy_text(port: int) -> str:
    status, raw = post(port, "/v1/completions", json.dumps(GREEDY).encode())
    assert status == 200, raw[:500]
    return str(json.loads(raw)["choices"][0]["text"])


def check_answer(status: int, raw: bytes, what: object) -> None:
    assert status < 500, (status, raw[:500], what)
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"] and "param" in error, (error, what)


# ------------------------------------------------------------------- schemathesis, stateful


def test_stateful_links_never_5xx_and_greedy_unchanged(server):
    server.wait_serving()
    port = server.http_port
    reference = greedy_text(port)
    base = f"http://127.0.0.1:{port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    steps: list[tuple[str, int]] = []

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case: Any) -> None:
            if isinstance(case.body, dict):
                for field, cap in CAPS.items():
                    value = case.body.get(field)
                    if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                        case.body[field] = cap

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": base, "timeout": 60}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            steps.append((case.operation.label, response.status_code))
            check_answer(response.status_code, response.content, case.as_curl_command())
            assert greedy_text(port) == reference, case.as_curl_command()

    Workflow.run(settings=settings(max_examples=6, stateful_step_count=3, deadline=None,
                                   database=None, derandomize=True,
                                   suppress_health_check=list(HealthCheck)))
    labels = {label for label, _ in steps}
    # /v1/models has no incoming link, so runs start there; the others are reached through links.
    assert {"GET /v1/models", "POST /tokenize"} <= labels, labels
    assert any(s == 200 for _, s in steps) and any(400 <= s < 500 for _, s in steps)


# ------------------------------------------------------------------- our own strategies

BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
# Where a hostile value goes, per route: a path into the body (a str: a key, an int: an index).
SPOTS: dict[str, list[tuple[Any, ...]]] = {
    "/v1/completions": [("prompt",), ("prompt", 0), ("model",), ("max_tokens",), ("n",),
                        ("seed",), ("priority",), ("stop",), ("temperature",), ("stream",),
                        ("logit_bias", "5"), ("stop_token_ids", 0), ("response_format",),
                        ("echo",), ("unknown",)],
    "/v1/chat/completions": [("messages", 0, "content"), ("messages", 0, "role"),
                             ("messages", 0, "name"), ("messages",), ("model",),
                             ("max_completion_tokens",), ("top_logprobs",), ("tools",),
                             ("response_format",), ("logprobs",)],
    "/tokenize": [("prompt",), ("messages",), ("model",), ("add_special_tokens",)],
    "/detokenize": [("tokens",), ("tokens", 0), ("model",)],
}

surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), surrogate,
                           st.text(max_size=5))
huge_int = st.one_of(st.integers(min_value=2**31, max_value=2**200),
                     st.integers(min_value=-(2**200), max_value=-(2**31) - 1),
                     st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**12]))
extreme_float = st.one_of(st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308,
                                           -1e308, 5e-324]), st.floats())


def nested(depth: int, leaf: Any, kind: str) -> Any:
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"a": leaf}
    return leaf


deep = st.builds(nested, st.integers(min_value=30, max_value=400), st.just(1),
                 st.sampled_from(["list", "dict"]))
wrong_type = st.one_of(st.just("10"), st.just("yes"), st.just(None), st.booleans(),
                       st.just([]), st.just({}), st.just([[[]]]), st.floats(0.5, 3.5))
hostile = st.one_of(surrogate_text, huge_int, extreme_float, deep, wrong_type,
                    st.lists(huge_int, min_size=1, max_size=3),
                    st.lists(surrogate_text, min_size=1, max_size=3),
                    st.dictionaries(surrogate_text, st.integers(), min_size=1, max_size=2))


def placed(body: dict[str, Any], spot: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """body with value at spot (a fresh copy; a missing list or dict on the way is made)."""
    body = json.loads(json.dumps(body))
    node: Any = body
    for key, next_key in zip(spot, spot[1:], strict=False):
        if isinstance(node, dict) and not isinstance(node.get(key), list | dict):
            node[key] = [None] if isinstance(next_key, int) else {}
        elif isinstance(node, list) and not isinstance(node[key], list | dict):
            node[key] = [None] if isinstance(next_key, int) else {}
        node = node[key]
    node[spot[-1]] = value
    return body


@st.composite
def hostile_requests(draw: Any) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BASES)))
    spot = draw(st.sampled_from(SPOTS[path]))
    body = placed(BASES[path], spot, draw(hostile))
    text = json.dumps(body)  # lone surrogates leave as \udXXX escapes; NaN, Infinity as such
    if draw(st.booleans()) and "\\ud" in text:  # the same, as raw (invalid UTF-8) bytes
        return path, json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return path, text.encode()


def test_hostile_values_never_5xx_and_greedy_unchanged(server):
    server.wait_serving()
    port = server.http_port
    reference = greedy_text(port)
    statuses: list[int] = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=hostile_requests())
    def call(request: tuple[str, bytes]) -> None:
        path, body = request
        status, raw = post(port, path, body)
        statuses.append(status)
        check_answer(status, raw, request)
        assert greedy_text(port) == reference, request

    call()
    assert sum(400 <= s < 500 for s in statuses) > len(statuses) // 2, statuses
