"""The admitted prompts' outputs as one stream of (prompt index, GenerateResponse), in arrival
order, and the usage they add up to. Each prompt's messages come from
parallel_sampling.responses, the servicer's own merge of its n sequences."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.service import parallel_sampling
from scheduler_svc.service.openai.context import Admitted


async def merged(admitted: Sequence[Admitted], continuous_usage: bool = False
                 ) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    sources = [parallel_sampling.responses(a.request_id, a.streams, continuous_usage)
               for a in admitted]
    if len(sources) == 1:  # the common case, without tasks and a queue
        async for msg in sources[0]:
            yield 0, msg
        return
    async for i, msg in parallel_sampling.merge(sources):
        yield i, msg


class UsageTotal:
    """The latest usage of each prompt (its last message's, or the running one's with
    continuous usage), summed over prompts."""

    def __init__(self, num_prompts: int, count_completion: bool = True) -> None:
        self.latest: list[generate_pb2.Usage | None] = [None] * num_prompts
        self.count_completion = count_completion  # False: echo with max_tokens 0

    def update(self, prompt: int, msg: generate_pb2.GenerateResponse) -> None:
        if msg.HasField("usage"):
            self.latest[prompt] = msg.usage

    def as_dict(self) -> dict[str, Any]:
        known = [u for u in self.latest if u is not None]
        prompt = sum(u.prompt_tokens for u in known)
        completion = sum(u.completion_tokens for u in known) if self.count_completion else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in known)}}
