"""The scheduler's Prometheus metrics, served as text on /metrics (port 9090 by default).

Each server owns a registry of its own rather than the process-wide default, so that a test
process may run several. Gauges are set by the engine thread after every step; per-request
histograms are observed on the event loop when a request finishes.
"""

from __future__ import annotations

import time

from batchwire.common.metrics_http import serve_metrics
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.engine.async_engine import EngineStats, RequestStream

# Seconds. Decode steps of a small model on a CPU take tens of milliseconds, prefills of long
# prompts on a busy server seconds: the buckets span both.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.running = Gauge("batchwire_num_requests_running", "Requests in the running batch.",
                             registry=r)
        self.waiting = Gauge("batchwire_num_requests_waiting", "Requests in the waiting queue.",
                             registry=r)
        self.kv_usage = Gauge("batchwire_kv_cache_usage_ratio",
                              "Fraction of KV-cache blocks held by unfinished requests.",
                              registry=r)
        self.prefix_hit_rate = Gauge("batchwire_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / looked up, "
                                     "since start.", registry=r)
        self.prefix_queries = Counter("batchwire_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("batchwire_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", registry=r)
        self.preemptions = Counter("batchwire_num_preemptions",
                                   "Requests preempted (to be recomputed).", registry=r)
        self.steps = Counter("batchwire_engine_steps", "Engine steps run.", registry=r)
        self.batch_invariant = Gauge("batchwire_batch_invariant", "1 when every worker replica "
                                     "runs in batch-invariant mode (--batch-invariant).",
                                     registry=r)
        self.refused = Counter("batchwire_refused_requests",
                               "Requests past admission that a worker refused (each failed "
                               "alone; the step went on without it).", registry=r)
        self.ttft = Histogram("batchwire_time_to_first_token_seconds",
                              "From arrival to the first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("batchwire_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("batchwire_e2e_request_latency_seconds",
                             "From arrival to the last output token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("batchwire_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter("batchwire_generation_tokens",
                                         "Output tokens of finished requests.", registry=r)
        # Every way a request ends, cancelled streams included ("abort"); vLLM's label names.
        self.finished = Counter("batchwire_request_finished", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        # Per LoRA adapter, by the name its requests gave (requests of the base model are not
        # counted here): finished requests and their tokens.
        self.lora_finished = Counter("batchwire_lora_requests_finished", "Finished requests "
                                     "per LoRA adapter.", ["lora_name"], registry=r)
        self.lora_prompt_tokens = Counter("batchwire_lora_prompt_tokens", "Prompt tokens of "
                                          "finished requests per LoRA adapter.", ["lora_name"],
                                          registry=r)
        self.lora_generation_tokens = Counter("batchwire_lora_generation_tokens", "Output "
                                              "tokens of finished requests per LoRA adapter.",
                                              ["lora_name"], registry=r)
        self.model_name = ""  # set once the model is loaded
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes
        PlatformCollector(registry=r)  # python_info
        self.spec_drafts = Counter("batchwire_spec_decode_num_drafts", "Request-steps that "
                                   "verified draft tokens.", registry=r)
        self.spec_draft_tokens = Counter("batchwire_spec_decode_num_draft_tokens",
                                         "Draft tokens proposed and verified.", registry=r)
        self.spec_accepted_tokens = Counter("batchwire_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter(
            "batchwire_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a step's drafts (0 = the first).",
            ["position"], registry=r)
        self._last = EngineStats()

    def count_from(self, stats: EngineStats) -> None:
        """The counters advance from these stats on: the server's warm-up steps ran before it
        served, and would otherwise be counted at the first step after it."""
        self._last = stats

    def observe_engine(self, stats: EngineStats) -> None:
        """Called by the engine thread after each step; counters advance by the step's delta."""
        last, self._last = self._last, stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.steps.inc(max(stats.num_steps - last.num_steps, 0))
        self.preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        self.refused.inc(max(stats.num_refused_requests - last.num_refused_requests, 0))
        self.prefix_queries.inc(max(stats.num_prefix_queries - last.num_prefix_queries, 0))
        self.prefix_hits.inc(max(stats.num_prefix_hits - last.num_prefix_hits, 0))
        if stats.num_prefix_queries:
            self.prefix_hit_rate.set(stats.num_prefix_hits / stats.num_prefix_queries)
        if stats.num_draft_tokens != last.num_draft_tokens:
            self._observe_spec_decode(stats, last)

    def _observe_spec_decode(self, stats: EngineStats, last: EngineStats) -> None:
        self.spec_drafts.inc(max(stats.num_spec_requests - last.num_spec_requests, 0))
        self.spec_draft_tokens.inc(max(stats.num_draft_tokens - last.num_draft_tokens, 0))
        self.spec_accepted_tokens.inc(
            max(stats.num_accepted_tokens - last.num_accepted_tokens, 0))
        before = last.accepted_per_position
        for j, n in enumerate(stats.accepted_per_position):
            delta = n - (before[j] if j < len(before) else 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(str(j)).inc(delta)

    def observe_finished(self, stream: RequestStream, last: EngineCoreOutput) -> None:
        now = time.monotonic()
        self.e2e.observe(now - stream.arrival)
        if stream.first_token_time is not None:
            self.ttft.observe(stream.first_token_time - stream.arrival)
            if last.num_output_tokens > 1:
                self.tpot.observe((now - stream.first_token_time) / (last.num_output_tokens - 1))
        self.prompt_tokens.inc(last.num_prompt_tokens)
        self.generation_tokens.inc(last.num_output_tokens)
        self.finished.labels(self.model_name, last.finish_reason or "unknown").inc()
        if stream.lora_name:
            self.lora_finished.labels(stream.lora_name).inc()
            self.lora_prompt_tokens.labels(stream.lora_name).inc(last.num_prompt_tokens)
            self.lora_generation_tokens.labels(stream.lora_name).inc(last.num_output_tokens)


__all__ = ["SchedulerMetrics", "serve_metrics"]
