"""A streamed response as OpenAI's typed SSE events (`event: <type>` and `data: {...}` with the
same type and a sequence number): created, in_progress, then per output item its added event,
its text or argument deltas and its done events, and completed with the whole response.

Text opens a message item; a call's name opens a function_call item (closing what was open);
text after a call opens a new message item.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from scheduler_svc.core.tool_calls import Deltas
from scheduler_svc.service.openai.responses_api.items import call_item, message_item


def sse(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


class OutputEvents:
    """The events of one response's output items, as its deltas arrive; `items` holds the
    finished items for the completed response."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""  # the open message's text
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def deltas(self, d: Deltas) -> Iterator[dict[str, Any]]:
        if d.text:
            if self.open is None or self.open["type"] != "message":
                yield from self.close()
                yield from self._open(message_item("", "in_progress"))
                assert self.open is not None
                part = {"type": "output_text", "text": "", "annotations": []}
                yield self._at("response.content_part.added", content_index=0, part=part)
            self.text += d.text
            yield self._at("response.output_text.delta", content_index=0, delta=d.text,
                           logprobs=[])
        for c in d.calls:
            if c.name is not None:
                yield from self.close()
                yield from self._open(call_item(c.id or "", c.name, "", "in_progress"))
            if c.arguments:
                assert self.open is not None
                self.open["arguments"] += c.arguments
                yield self._at("response.function_call_arguments.delta", delta=c.arguments)

    def close(self) -> Iterator[dict[str, Any]]:
        item = self.open
        if item is None:
            return
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": []}
            yield self._at("response.output_text.done", content_index=0, text=self.text,
                           logprobs=[])
            yield self._at("response.content_part.done", content_index=0, part=part)
            item = message_item(self.text, id=item["id"])
        else:
            yield self._at("response.function_call_arguments.done",
                           arguments=item["arguments"], name=item["name"])
            item = {**item, "status": "completed"}
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=len(self.items) - 1,
                         item=item)
        self.open, self.text = None, ""

    def _open(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.open = item
        yield self.event("response.output_item.added", output_index=len(self.items),
                         item=item)

    def _at(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self.open is not None
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items),
                          **fields)


async def framed(events: AsyncIterator[dict[str, Any]], failed: Any) -> AsyncIterator[str]:
    """The events as SSE; an error after the headers went out is one `error` event (what
    `failed(exception)` makes of it)."""
    try:
        async for payload in events:
            yield sse(payload)
    except Exception as e:
        yield sse(failed(e))

