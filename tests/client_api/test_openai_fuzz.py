"""A property-based fuzz run of the HTTP API from its own /openapi.json (schemathesis): valid and
invalid requests to every route, and never a 5xx; the server serves normally afterwards.

The number of examples is bounded, and so is the work a valid one may ask for (max_tokens and
n are capped before the call), so that the run takes seconds on a CPU.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

EXAMPLES = 40
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2,
        "min_tokens": 2}


def _bound(case) -> None:
    """Caps what a valid request may cost; values the API refuses are left as they are."""
    if isinstance(case.body, dict):
        for field, cap in CAPS.items():
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                case.body[field] = cap


def test_fuzzed_requests_never_get_a_5xx(server):
    base = server.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    strategy = st.one_of(*[op.as_strategy(mode) for op in operations
                           for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def call(case) -> None:
        _bound(case)
        response = case.call(base_url=base, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.text[:1000])
        if response.status_code >= 400 and response.content:
            error = response.json()["error"]  # every error is OpenAI's error object
            assert error["message"] and error["type"], error

    call()
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
    server.wait_idle()
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
