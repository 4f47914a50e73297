"""The worker's Prometheus metrics, served as text on /metrics (port 9091 by default)."""

from __future__ import annotations

import logging
from typing import Any

from batchwire.common.metrics_http import serve_metrics
from prometheus_client import CollectorRegistry, Counter, Histogram

logger = logging.getLogger(__name__)

# From a decode step of a few requests (~ms) to a long prefill on a CPU (~s).
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, rank: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = {"rank": str(rank)}
        self.execute_model = Histogram(
            "batchwire_worker_execute_model_seconds",
            "Time of ExecuteModel calls (forward pass)",
            ["rank"],
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.sample_tokens = Histogram(
            "batchwire_worker_sample_tokens_seconds",
            "Time of SampleTokens calls (sampling)",
            ["rank"],
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.scheduled_tokens = Counter(
            "batchwire_worker_scheduled_tokens",
            "Tokens computed by forward passes",
            ["rank"],
            registry=self.registry,
        ).labels(**labels)
        self.errors = Counter(
            "batchwire_worker_call_errors",
            "Calls answered with an error, by method",
            ["rank", "method"],
            registry=self.registry,
        )
        self.rank = str(rank)

    def observe(self, method: str, seconds: float, request: Any, ok: bool) -> None:
        if not ok:
            self.errors.labels(self.rank, method).inc()
            return
        if method == "ExecuteModel":
            self.execute_model.observe(seconds)
            self.scheduled_tokens.inc(request.total_num_scheduled_tokens)
        elif method == "SampleTokens":
            self.sample_tokens.observe(seconds)

    def serve(self, host: str, port: int) -> int | None:
        """Starts /metrics on a daemon thread; returns the bound port, or None if it is taken.

        A port taken after serve.py checked it is logged, not fatal.
        """
        try:
            _, bound = serve_metrics(self.registry, host, port)
        except OSError as e:  # taken since serve.py checked it: log, keep serving
            logger.warning("metrics not served on %s:%d: %s", host, port, e)
            return None
        return bound
