"""What a request's tools and tool_choice ask of a generation, for both fronts.

- "none" (or no tools): nothing; the tools are not shown to the model.
- "auto" (the default with tools): the tools are described in the prompt, the model decides, and
  its reply is read with the server's tool-call format; without one, refused. With a strict tool,
  or parallel_tool_calls false, the reply is also constrained (grammar.py): free text, and calls
  whose arguments fit (a strict tool's), at most one when parallel_tool_calls is false.
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
    strict: bool = False  # under auto too, the arguments are constrained to `parameters`

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
    single: bool = False  # parallel_tool_calls false: at most one call
    field: str = "tools[{}].function"  # how the request spells a tool (refusals name it)

    @property
    def constrained(self) -> bool:
        """The whole output is one call's JSON (required, a named function)."""
        return self.schema is not None

    @property
    def tagged(self) -> bool:
        """Auto, with the reply held to a grammar of free text and tagged calls."""
        return self.parses and (self.single or any(t.strict for t in self.tools))


def plan_tools(tools: list[ToolSpec], choice: str | None, function: str | None,
               fmt: ToolCallFormat | None, field: str = "tools[{}].function",
               parallel: bool = True) -> ToolPlan:
    """choice: one of CHOICES ("function" with `function` naming it), None when not sent;
    parallel: parallel_tool_calls. Refusals name the field (`tool_choice`, a tool's name or
    parameters under `field`, the request's spelling of tools[i])."""
    if choice is not None and choice not in CHOICES:
        raise InvalidRequestError("tool_choice", f"{choice!r} is not one of {', '.join(CHOICES)}")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "given without tools")
        return ToolPlan([], None, None, fmt, field=field)
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if not name or names.index(name) != i:
            raise InvalidRequestError(f"{field.format(i)}.name", f"{name!r} is empty or "
                                      "repeats an earlier tool's name")
    if choice == "none":
        return ToolPlan([], None, None, fmt, field=field)
    if choice in (None, "auto"):
        if fmt is None:
            raise InvalidRequestError(
                "tool_choice", "'auto' (the default with tools) reads the model's own "
                "tool-call syntax, and this model's chat template shows none that the server "
                "knows; start it with --tool-call-parser smollm2|hermes|llama3_json, or send "
                "tool_choice 'required' or a named function (the output is then constrained)")
        return ToolPlan(tools, None, None, fmt, parses=True, single=not parallel, field=field)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                                   "arguments": t.parameters or ANY_OBJECT},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in tools]
        return ToolPlan(tools, {"anyOf": calls} if len(calls) > 1 else calls[0], None, fmt,
                        single=True, field=field)
    chosen = [t for t in tools if t.name == function]
    if not chosen:
        raise InvalidRequestError("tool_choice", f"function {function!r} is not among the "
                                  f"tools ({', '.join(names)})")
    return ToolPlan(tools, chosen[0].parameters or ANY_OBJECT, chosen[0].name, fmt, single=True,
                    field=field)
