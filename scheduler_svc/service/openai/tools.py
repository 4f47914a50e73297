"""A chat request's tools and tool_choice as a ToolPlan (core/tool_calls/choice.py says what
each choice does), and the replies' calls in OpenAI's shapes: whole, or as stream deltas."""

from __future__ import annotations

from typing import Any

from scheduler_svc.core.tool_calls import (
    CallDelta,
    Deltas,
    ToolCall,
    ToolCallFormat,
    ToolCallStream,
    ToolPlan,
    ToolSpec,
)
from scheduler_svc.core.tool_calls import plan_tools as plan
from scheduler_svc.service.openai.protocol import ChatCompletionRequest, NamedToolChoice, Tool


def specs(tools: list[Tool] | None) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, t.function.description, t.function.parameters,
                     bool(t.function.strict)) for t in tools or ()]


def choice_of(choice: str | NamedToolChoice | None) -> tuple[str | None, str | None]:
    """(the choice, the function it names)."""
    if isinstance(choice, NamedToolChoice):
        return "function", choice.function.name
    return choice, None


def tool_plan(body: ChatCompletionRequest, fmt: ToolCallFormat | None) -> ToolPlan:
    choice, function = choice_of(body.tool_choice)
    return plan(specs(body.tools), choice, function, fmt,
                parallel=body.parallel_tool_calls is not False)


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(delta: CallDelta) -> dict[str, Any]:
    """A streamed call's delta: the first carries its id and name, the rest argument text."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


class StreamedCalls:
    """Each choice's text read for calls as it streams (tool_choice auto), as chat deltas."""

    def __init__(self, fmt: ToolCallFormat | None) -> None:
        assert fmt is not None, "auto always has a format (plan_tools refuses it otherwise)"
        self.fmt = fmt
        self.parsers: dict[int, ToolCallStream] = {}
        self.called: set[int] = set()  # the choices that made a call

    def deltas(self, index: int, text: str, finished: bool) -> Deltas:
        parser = self.parsers.setdefault(index, ToolCallStream(self.fmt))
        out = parser.feed(text)
        if finished:
            last = parser.finish()
            out.text += last.text
            out.calls += last.calls
        if out.calls:
            self.called.add(index)
        return out

    def delta(self, index: int, text: str, finished: bool) -> dict[str, Any]:
        out = self.deltas(index, text, finished)
        delta: dict[str, Any] = {"content": out.text} if out.text else {}
        if out.calls:
            delta["tool_calls"] = [delta_json(d) for d in out.calls]
        return delta

    def finish_reason(self, index: int, reason: str) -> str:
        return "tool_calls" if index in self.called else reason
