"""Serving metrics from per-request timings, as `vllm bench serve` users read them.

TTFT: from sending a request to its first token. TPOT: the rest of the request's time over its
other output tokens, (E2E - TTFT) / (tokens - 1). ITL: the gaps between successive messages that
carry tokens, over all requests. E2E: from sending to the last message. Throughputs are over the
whole run's wall time.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from batchwire.benchmarks.serving.request_record import RequestRecord

PERCENTILES = (50, 90, 99)


def distribution(values_s: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    ms = sorted(1e3 * v for v in values_s)
    if not ms:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    return {"mean": statistics.fmean(ms), **{f"p{p}": _percentile(ms, p) for p in PERCENTILES}}


def _percentile(ordered: Sequence[float], p: float) -> float:
    """Linear interpolation between the two nearest ranks."""
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def serving_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict:
    done = [r for r in records if not r.error and r.chunk_times]
    ttft = [r.chunk_times[0] - r.sent for r in done]
    e2e = [r.chunk_times[-1] - r.sent for r in done]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1)
            for r in done if r.num_output_tokens > 1]
    itl = [b - a for r in done for a, b in itertools.pairwise(r.chunk_times)]
    output = sum(r.num_output_tokens for r in done)
    prompt = sum(r.prompt_len for r in done)
    return {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "request_throughput": len(done) / duration_s, "output_tok_s": output / duration_s,
        "total_tok_s": (prompt + output) / duration_s,
        "ttft_ms": distribution(ttft), "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl), "e2e_ms": distribution(e2e),
        "errors": sorted({r.error for r in records if r.error}),
    }
