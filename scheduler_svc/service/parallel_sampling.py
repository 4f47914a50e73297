"""A request's n sequences as one stream of GenerateResponse messages.

Each sequence is a request of its own in the engine (core/parallel_sampling.py); here their
streams are merged as outputs arrive, each message tagged with its sequence's `index`. Usage is
for the whole request (the prompt once, every sequence's completion tokens summed), on the
stream's last message only, or on every message with continuous usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from batchwire.v1 import generate_pb2

from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.engine.async_engine import RequestStream
from scheduler_svc.service import wire

T = TypeVar("T")


async def responses(request_id: str, streams: Sequence[RequestStream],
                    continuous_usage: bool = False
                    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """With continuous_usage every message carries the usage so far, else the last one only."""
    if len(streams) == 1:  # the common case, without the merge's tasks and queue
        async for out in streams[0]:
            yield wire.response(request_id, out, continuous_usage)
        return
    latest: dict[int, EngineCoreOutput] = {}  # each sequence's latest output, by index
    finished = 0
    async for index, out in merge(streams):
        msg = wire.response(request_id, out)
        msg.index = index
        latest[index] = out
        finished += out.finished
        if continuous_usage or finished == len(streams):
            _total_usage(msg.usage, latest)
        else:
            msg.ClearField("usage")
        yield msg


def _total_usage(usage: generate_pb2.Usage, latest: dict[int, EngineCoreOutput]) -> None:
    # Sequence 0 was admitted first and prefilled the prompt; until it has output, another's
    # counts stand in (every sequence has the same prompt).
    first = latest.get(0) or next(iter(latest.values()))
    usage.prompt_tokens = first.num_prompt_tokens
    usage.cached_tokens = first.num_cached_tokens
    usage.completion_tokens = sum(out.num_output_tokens for out in latest.values())
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) in arrival order, until every stream ended; an error in any
    stream ends them all (the caller closes the streams, which aborts what still runs)."""
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
