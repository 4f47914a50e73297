"""Prompt logprobs as they arrive from the worker, one prefill chunk per step."""

from __future__ import annotations

from batchwire.v1 import worker_pb2

from scheduler_svc.core.outputs import TokenLogprobs
from scheduler_svc.core.request import Request


def collect_prompt_logprobs(request: Request | None, entry: worker_pb2.PromptLogprobs) -> None:
    """Appends a step's positions to the request's list. A request that sent them already (it
    was preempted afterwards and its prompt recomputed) or that was aborted ignores them."""
    if request is None or request.prompt_logprobs is None:
        return
    request.prompt_logprobs.extend(
        TokenLogprobs(list(p.token_ids), list(p.logprobs), p.sampled_token_rank)
        for p in entry.positions)
