"""Tools on the Generation wire: a GenerateRequest's tools and tool choice as a ToolPlan, what
the plan constrains in a SamplingParams message (every front's), its messages as the chat
template's conversation, and parsed calls back as protobuf."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls import (
    ToolCall,
    ToolCallFormat,
    ToolPlan,
    ToolSpec,
    past_call,
    plan_tools,
    tool_constraint,
)

_CHOICES = {
    generate_pb2.TOOL_CHOICE_UNSPECIFIED: None,
    generate_pb2.TOOL_CHOICE_AUTO: "auto",
    generate_pb2.TOOL_CHOICE_NONE: "none",
    generate_pb2.TOOL_CHOICE_REQUIRED: "required",
    generate_pb2.TOOL_CHOICE_FUNCTION: "function",
}


def tool_specs(msg: generate_pb2.GenerateRequest) -> list[ToolSpec]:
    specs = []
    for i, tool in enumerate(msg.tools):
        parameters = None
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except ValueError as e:
                raise InvalidRequestError(f"tools[{i}].parameters", f"not JSON: {e}") from None
            if not isinstance(parameters, dict):
                raise InvalidRequestError(f"tools[{i}].parameters", "must be a JSON object "
                                          "(a JSON Schema)")
        specs.append(ToolSpec(tool.name, tool.description or None, parameters, tool.strict))
    return specs


def tool_plan(msg: generate_pb2.GenerateRequest, fmt: ToolCallFormat | None) -> ToolPlan:
    if msg.tools and not msg.messages:
        raise InvalidRequestError("tools", "need a chat prompt (messages)")
    choice = _CHOICES.get(msg.tool_choice)
    if msg.tool_choice not in _CHOICES:
        raise InvalidRequestError("tool_choice", f"{msg.tool_choice} is not a ToolChoice")
    if msg.tool_choice_function and choice != "function":
        raise InvalidRequestError("tool_choice_function", "set only with "
                                  "TOOL_CHOICE_FUNCTION")
    parallel = not msg.HasField("parallel_tool_calls") or msg.parallel_tool_calls
    return plan_tools(tool_specs(msg), choice, msg.tool_choice_function or None, fmt, "tools[{}]",
                      parallel)


async def constrain(plan: ToolPlan, sampling: generate_pb2.SamplingParams, other: str) -> None:
    """Sets the constraint the plan asks for (a call's JSON, or auto's grammar of tagged calls)
    in `sampling`. One set there already (`other` names its request field) is refused: a
    request has one constraint. Off the event loop: the schemas are checked with xgrammar,
    whose first import takes seconds."""
    if not (plan.constrained or plan.tagged):
        return
    if sampling.WhichOneof("constraint") is not None:
        asked = ("tool_choice auto with a strict tool or parallel_tool_calls false"
                 if plan.tagged else "a tool_choice that names the call (required, a function)")
        raise InvalidRequestError(other, f"cannot be combined with {asked}, which constrains "
                                  "the output itself")
    got = await asyncio.get_running_loop().run_in_executor(None, tool_constraint, plan)
    assert got is not None
    setattr(sampling, *got)


def conversation(messages: Any) -> list[dict[str, Any]]:
    """Generate's messages as the chat template's: role and content, and an assistant turn's
    calls and a tool turn's call id where set."""
    out = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidRequestError(f"messages[{i}].role", "must not be empty")
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [past_call(c.name, c.arguments) for c in m.tool_calls]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def tool_calls_pb(calls: list[ToolCall]) -> list[generate_pb2.ToolCall]:
    return [generate_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]
