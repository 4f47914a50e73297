"""What the engine hands back: a per-step delta per request, and the offline API's final result."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class TokenLogprobs:
    token_ids: list[int]  # [1 + n]: the sampled token, then the top n
    logprobs: list[float]  # [1 + n]
    sampled_token_rank: int  # 1 = the most likely token


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """What one step added to one request; the last one for a request has finished=True."""

    request_id: str  # the client's id
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # On a request's first output when it asked: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # [hidden or dimensions]: an embedding request's vector
    error: str | None = None  # why the worker refused it (finish_reason "abort"); its stream fails


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """One finished request, as LLM.generate returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # LLM.embed's vector
    error: str | None = None  # why the engine ended it early (finish_reason "abort")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
