"""A finished reply's text as the tool plan reads it: calls in the model's syntax (auto), one call
made of the constrained JSON (required, a named function), or just text."""

from __future__ import annotations

import json

from scheduler_svc.core.tool_calls.choice import ToolPlan
from scheduler_svc.core.tool_calls.stream import (
    CallDelta,
    Deltas,
    ParsedReply,
    ToolCall,
    ToolCallStream,
    new_call_id,
    parse,
)


def read_reply(plan: ToolPlan, text: str) -> ParsedReply:
    if plan.parses:
        assert plan.fmt is not None
        return parse(plan.fmt, text)
    if plan.constrained:
        call = constrained_call(plan, text)
        return ParsedReply(None, [call]) if call is not None else ParsedReply(text, [])
    return ParsedReply(text, [])


def constrained_call(plan: ToolPlan, text: str) -> ToolCall | None:
    """The constrained output as a call, or None when it is not the JSON it was constrained to
    be (cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.function is not None:
        name, arguments = plan.function, value
    elif isinstance(value, dict) and "name" in value and "arguments" in value:
        name, arguments = value["name"], value["arguments"]
    else:
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


class ReplyReader:
    """A reply read as it streams, as its plan says: through a ToolCallStream (auto), held to
    its end and sent as one call (a constrained call), or passed through as text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.fmt) if plan.parses and plan.fmt else None
        self.held: list[str] = []
        self.called = False  # a call was sent

    def feed(self, text: str) -> Deltas:
        if self.stream is not None:
            return self._seen(self.stream.feed(text))
        if self.plan.constrained:
            self.held.append(text)
            return Deltas()
        return Deltas(text)

    def finish(self) -> Deltas:
        if self.stream is not None:
            return self._seen(self.stream.finish())
        if not self.plan.constrained:
            return Deltas()
        reply = read_reply(self.plan, "".join(self.held))
        calls = [d for i, c in enumerate(reply.calls)
                 for d in (CallDelta(i, "", c.id, c.name), CallDelta(i, c.arguments))]
        return self._seen(Deltas(reply.content or "", calls))

    def _seen(self, deltas: Deltas) -> Deltas:
        self.called = self.called or bool(deltas.calls)
        return deltas
