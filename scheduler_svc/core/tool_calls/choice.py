"""What a request's tools and tool_choice ask of a generation, for both fronts.

- "none" (or no tools): nothing; the tools are not shown to the model.
- "auto" (the default with tools): the tools are described in the prompt, the model decides, and
  its reply is read with the server's tool-call format; without one, refused.
- "required": the output is constrained to `{"name": <a tool>, "arguments": <its parameters>}`.
- a function's name: the output is constrained to that function's arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls.formats import ToolCallFormat

ANY_OBJECT: dict[str, Any] = {"type": "object"}
CHOICES = ("auto", "none", "required", "function")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: any object

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates (and the prompt's description) take it."""
        function: dict[str, Any] = {"name": self.name,
                                    "parameters": self.parameters or ANY_OBJECT}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[ToolSpec]  # what the prompt shows the model (empty: nothing)
    schema: dict[str, Any] | None  # what the output is constrained to, if anything
    function: str | None  # the named function the output's JSON is the arguments of
    fmt: ToolCallFormat | None  # the server's syntax: earlier calls are written in it
    parses: bool = False  # auto: the reply is read in fmt's syntax

    @property
    def constrained(self) -> bool:
        return self.schema is not None


def plan_tools(tools: list[ToolSpec], choice: str | None, function: str | None,
               fmt: ToolCallFormat | None, name_field: str = "tools[{}].function.name"
               ) -> ToolPlan:
    """choice: one of CHOICES ("function" with `function` naming it), None when not sent.
    Refusals name the field (`tool_choice`, a tool's name as `name_field` spells it)."""
    if choice is not None and choice not in CHOICES:
        raise InvalidRequestError("tool_choice", f"{choice!r} is not one of {', '.join(CHOICES)}")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "given without tools")
        return ToolPlan([], None, None, fmt)
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if not name or names.index(name) != i:
            raise InvalidRequestError(name_field.format(i), f"{name!r} is empty or "
                                      "repeats an earlier tool's name")
    if choice == "none":
        return ToolPlan([], None, None, fmt)
    if choice in (None, "auto"):
        if fmt is None:
            raise InvalidRequestError(
                "tool_choice", "'auto' (the default with tools) reads the model's own "
                "tool-call syntax, and this model's chat template shows none that the server "
                "knows; start it with --tool-call-parser smollm2|hermes|llama3_json, or send "
                "tool_choice 'required' or a named function (the output is then constrained)")
        return ToolPlan(tools, None, None, fmt, parses=True)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                                   "arguments": t.parameters or ANY_OBJECT},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in tools]
        return ToolPlan(tools, {"anyOf": calls} if len(calls) > 1 else calls[0], None, fmt)
    chosen = [t for t in tools if t.name == function]
    if not chosen:
        raise InvalidRequestError("tool_choice", f"function {function!r} is not among the "
                                  f"tools ({', '.join(names)})")
    return ToolPlan(tools, chosen[0].parameters or ANY_OBJECT, chosen[0].name, fmt)
