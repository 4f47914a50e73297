"""A request's life in the scheduler: waiting -> running -> (preempted -> waiting) -> finished."""

from __future__ import annotations

import enum
import time

from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.outputs import TokenLogprobs
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, to be recomputed from scratch
    # Finished states sort after the others so that `is_finished` is one comparison.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Mutable per-request state; the scheduler and the KV cache manager are its only writers."""

    __slots__ = (
        "wire_id", "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
        "arrival_time", "priority", "cache_salt", "status", "stop_reason", "all_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_preemptions", "block_hashes",
        "stop_ids", "max_num_tokens", "num_cached_tokens", "grammar",
        "prompt_logprobs",
        "pooling", "num_sent_tokens", "num_output_placeholders", "lora",
    )

    def __init__(
        self,
        wire_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        # Two ids: `request_id` is the client's (unique among active requests of an engine, the
        # key of every map above the scheduler); `wire_id` is the short one the worker sees
        # (unique within one scheduler), which keeps a SchedulerOutput small.
        self.wire_id = wire_id
        self.request_id = request_id if request_id is not None else wire_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower runs first under the priority policy
        self.cache_salt = cache_salt  # keeps prefix-cache hits within one tenant
        self.lora = lora  # the adapter it runs with; None = the base model
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that hit
        self.all_token_ids = list(prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose KV is (or is being, this step) written; prefix-cache hits count.
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, grown lazily
        self.grammar: RequestGrammar | None = None  # the matcher of a constrained request
        # Collected across prefill chunks until the first output takes them; None = not asked,
        # or sent already.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.pooling: PoolingParams | None = None  # set on an embedding request
        # Tokens the workers have been sent (prompt, then output): with pipeline stages, the
        # stages before the last learn each later token from the scheduler.
        self.num_sent_tokens = 0
        # Async scheduling: tokens that steps already sent will sample for this request, not yet
        # appended; schedule() counts them as if they were there.
        self.num_output_placeholders = 0
        # A token outside stop_ids with fewer than max_num_tokens tokens cannot end the request:
        # the per-token test on the hot path, before the full stop rules.
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        if max_model_len is not None:
            self.max_num_tokens = min(self.max_num_tokens, max_model_len)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r} wire {self.wire_id!r}, {self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
