"""Server-Sent Events as OpenAI frames them, and a client's disconnect as an abort.

A stream is `data: {json}` events, then `data: [DONE]`. An error after the headers went out
cannot change the status any more: it goes as one `data: {"error": ...}` event before [DONE].
Whatever ends the response (its end, an error, the client leaving, the response never being
sent), the request's streams are released, which aborts what still runs and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler_svc.service.openai.errors import OpenAIError, as_body

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def framed(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for payload in events:
            yield event(payload)
    except Exception as e:  # the engine died mid-stream: say so, then end the stream properly
        yield event(as_body(e)[1])
    yield DONE


class EventStream(StreamingResponse):
    """text/event-stream whose release() runs however the response ends. Starlette watches
    for the client's disconnect while it streams (ASGI < 2.4, as uvicorn speaks) and cancels
    the stream, which lands in release() too."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], release: Callable[[], None],
                 frame: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[str]] = framed
                 ) -> None:
        super().__init__(frame(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """work's result, unless the client leaves first: then work is cancelled (its streams are
    released) and the handler answers 499, which nobody reads."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise OpenAIError(499, "the client disconnected")
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
