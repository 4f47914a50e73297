"""/metrics counts every way a request ends, a cancelled stream included, and its port answers
nothing but /metrics."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

import pytest

from tests.client_api.server_process import greedy, text_request

pytestmark = pytest.mark.slow


def _value(text: str, pattern: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(pattern + r" (\S+)$", text, re.M))


ABORTED = r'^batchwire_request_finished_total\{finished_reason="abort",model_name="[^"]+"\}'
E2E = r"^batchwire_e2e_request_latency_seconds_count"
GENERATED = r"^batchwire_generation_tokens_total"


def test_a_cancelled_stream_is_counted_as_abort(server):
    server.wait_idle()
    before = server.metrics()
    call = server.stub.Generate(text_request("Count to a hundred:", greedy(200, ignore_eos=True)),
                                timeout=60)
    next(call)  # the request runs and has produced tokens
    next(call)
    call.cancel()
    deadline = time.monotonic() + 30
    while _value(text := server.metrics(), ABORTED) == _value(before, ABORTED):
        assert time.monotonic() < deadline, f"the cancelled request was never counted:\n{text}"
        time.sleep(0.1)
    assert _value(text, ABORTED) == _value(before, ABORTED) + 1
    assert _value(text, E2E) == _value(before, E2E) + 1
    assert _value(text, GENERATED) >= _value(before, GENERATED) + 2
    assert "process_resident_memory_bytes" in text and "process_cpu_seconds_total" in text


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/metricsx"])
def test_the_metrics_port_answers_404_elsewhere(server, path):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{path}", timeout=10)
    assert e.value.code == 404
    assert "batchwire_" in server.metrics()


def test_the_counters_start_from_the_stats_the_server_attaches_them_at():
    """The server attaches its metrics after its warm-up request: from the engine's stats then,
    or the first step after it would count the warm-up's steps as served ones."""
    from prometheus_client import generate_latest

    from scheduler_svc.engine.async_engine import EngineStats
    from scheduler_svc.service.metrics import SchedulerMetrics

    metrics = SchedulerMetrics()
    metrics.count_from(EngineStats(num_steps=3, num_prefix_queries=2, num_prefix_hits=1))
    metrics.observe_engine(EngineStats(num_steps=5, num_prefix_queries=2, num_prefix_hits=1))
    text = generate_latest(metrics.registry).decode()
    assert _value(text, r"^batchwire_engine_steps_total") == 2
    assert _value(text, r"^batchwire_prefix_cache_queries_total") == 0


def test_batch_invariant_mode_is_reported_off_by_default(server):
    assert not server.server_info().batch_invariant
    assert re.search(r"^batchwire_batch_invariant 0\.0$", server.metrics(), re.M)
