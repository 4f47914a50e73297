"""What a tool plan constrains the output to, as a request's one constraint.

- "required" / a named function: the call's JSON (choice.py builds the JSON Schema).
- "auto" with a strict tool, or with parallel_tool_calls false: the trigger approach. The reply
  is free text until the format's tag opens a call; from there it must be calls of the request's
  tools (a strict tool's arguments follow its JSON Schema, another's are any object) up to the
  closing tag, and free text again after it. With parallel_tool_calls false the one region holds
  one call and the reply ends with it. Llama 3's JSON has no tag: a reply that starts with `{`
  is the calls, anything else is text that does not.

Every schema the grammar constrains to is checked on its own first, so that a refusal names the
tool's field. The reply is still read by the format's parser: the grammar only makes sure that
what the parser finds is a call of a known tool with arguments that fit.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.structured_output.constraint import constraint_from_fields
from scheduler_svc.core.structured_output.tagged import (
    schema_problem,
    structural_tag_ebnf,
    tag_json,
)
from scheduler_svc.core.tool_calls.choice import ANY_OBJECT, ToolPlan, ToolSpec
from scheduler_svc.core.tool_calls.formats import ToolCallFormat

# Whitespace a call's JSON may hold between tokens: enough for the `", "` and `": "` the models
# write (and a newline), not enough for a small model to pad a call forever.
MAX_JSON_WHITESPACE = 2
# Around the JSON inside a tag: Hermes-style templates write `<tool_call>\n{...}\n</tool_call>`.
_PADDING = {"type": "regex", "pattern": "[ \\n]{0,2}"}


def tool_constraint(plan: ToolPlan) -> tuple[str, str] | None:
    """(the SamplingParams constraint field, its text) the plan asks for, or None."""
    if plan.schema is not None:
        for i, tool in enumerate(plan.tools):
            if plan.function in (None, tool.name):
                _check_schema(plan, i, tool)
        return "json_schema", json.dumps(plan.schema, ensure_ascii=False)
    if not plan.tagged:
        return None
    assert plan.fmt is not None
    for i, tool in enumerate(plan.tools):
        if tool.strict:
            _check_schema(plan, i, tool)
    try:
        text = structural_tag_ebnf(tag_json(tagged_calls(plan.fmt, plan.tools, plan.single)))
    except ValueError as e:
        raise InvalidRequestError("tools", f"the tool-call grammar does not build: {e}") from None
    try:  # the bounds of any grammar (size), refused here under the tools' name on every front
        constraint_from_fields(grammar=text)
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", f"their tool-call grammar {e.message}") from None
    return "grammar", text


def tagged_calls(fmt: ToolCallFormat, tools: list[ToolSpec], single: bool) -> dict[str, Any]:
    """The structural tag's format: free text and calls in `fmt`'s syntax."""
    one_call = _json([_call(fmt, t) for t in tools])
    if fmt.name == "llama3_json":
        calls: dict[str, Any] = one_call
        if not single:
            more = {"type": "sequence", "elements": [{"type": "const_string", "value": "; "},
                                                     one_call]}
            calls = {"type": "sequence", "elements": [one_call, {"type": "star",
                                                                  "content": more}]}
        text = {"type": "sequence", "elements": [{"type": "regex", "pattern": "[^{ \\t\\r\\n]"},
                                                 {"type": "any_text"}]}
        return {"type": "or", "elements": [calls, text]}
    content = one_call
    if fmt.name == "smollm2":  # one JSON list of calls in one tag
        items = one_call["json_schema"]
        content = _json([{"type": "array", "items": items, "minItems": 1,
                          **({"maxItems": 1} if single else {})}])
    assert fmt.close_tag is not None
    tag = {"type": "tag", "begin": fmt.open_tag, "end": fmt.close_tag,
           "content": {"type": "sequence", "elements": [_PADDING, content, _PADDING]}}
    return {"type": "triggered_tags", "triggers": [fmt.open_tag], "tags": [tag],
            "stop_after_first": single}


def _call(fmt: ToolCallFormat, tool: ToolSpec) -> dict[str, Any]:
    arguments = (tool.parameters or ANY_OBJECT) if tool.strict else ANY_OBJECT
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             fmt.argument_key: arguments},
            "required": ["name", fmt.argument_key], "additionalProperties": False}


def _json(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"type": "json_schema", "json_schema": schema,
            "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _check_schema(plan: ToolPlan, index: int, tool: ToolSpec) -> None:
    """Refuses a tool's parameters that the grammar cannot constrain to, naming them."""
    if tool.parameters is None:
        return
    field = plan.field.format(index) + ".parameters"
    try:  # the bounds every json_schema constraint has (size, nesting)
        constraint = constraint_from_fields(json_schema=tool.parameters)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, e.message) from None
    assert constraint is not None
    problem = schema_problem(constraint.text)
    if problem is not None:
        raise InvalidRequestError(field, problem)
