"""Tool calls through the structured-output path: with `tool_choice: "required"` the output is
constrained to `{"name": <one of the tools>, "arguments": <that tool's parameters>}`; with a
named function, to that function's parameters. The JSON is returned as one tool call.

`tool_choice: "auto"` (OpenAI's default when tools are given) would need a parser for the
model's own tool-call syntax, which this server has not; it is refused, saying so.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from scheduler_svc.service.openai.errors import OpenAIError
from scheduler_svc.service.openai.protocol import ChatCompletionRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolMode:
    schema: dict[str, Any]  # what the output must match
    function: str | None  # the named function; None: the output names it


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice: given without tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError(400, "response_format: cannot be combined with a tool call",
                          "response_format")
    functions = {t.function.name: t.function for t in body.tools}
    if choice is None or choice == "auto":
        raise OpenAIError(400, "tool_choice: 'auto' (the default with tools) needs a parser "
                          "for this model's own tool-call syntax, which this server does not "
                          "have; send tool_choice 'required' or name a function, and the "
                          "output is constrained to a call", "tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": f.parameters or ANY_OBJECT},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, f in functions.items()]
        return ToolMode({"anyOf": calls} if len(calls) > 1 else calls[0], None)
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in functions:
        raise OpenAIError(400, f"tool_choice: function {name!r} is not among the tools "
                          f"({', '.join(functions)})", "tool_choice")
    return ToolMode(functions[name].parameters or ANY_OBJECT, name)


def tool_call(mode: ToolMode, text: str) -> dict[str, Any] | None:
    """The output as an OpenAI tool call, or None when it is not the JSON it was constrained to
    be (cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode.function is not None:
        name, arguments = mode.function, value
    elif isinstance(value, dict) and "name" in value and "arguments" in value:
        name, arguments = value["name"], value["arguments"]
    else:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
