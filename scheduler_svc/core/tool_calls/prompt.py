"""A conversation with tools, as the chat template takes it.

A template that renders `tools` itself (Qwen, Llama 3.1) gets them as its variable, and earlier
turns' calls as OpenAI's `tool_calls`. One that does not (the embedded SmolLM2's) gets the tools
described in a system message, and earlier calls written into the assistant's text in the
format's own syntax, so that the model sees what it is asked to write.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler_svc.core.tool_calls.choice import ToolSpec
from scheduler_svc.core.tool_calls.formats import ToolCallFormat, template_renders_tools


def past_call(name: str, arguments: str) -> dict[str, Any]:
    """An earlier turn's call ({"name", "arguments"}), its arguments parsed where they are
    JSON."""
    try:
        return {"name": name, "arguments": json.loads(arguments)}
    except ValueError:
        return {"name": name, "arguments": arguments}


def tool_conversation(conversation: list[dict[str, Any]], tools: list[ToolSpec],
                      fmt: ToolCallFormat | None, template: str | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages for the template, its `tools` variable or None). A message's "tool_calls"
    are past_call() dicts."""
    if template_renders_tools(template):
        native = [{**m, "tool_calls": [{"type": "function", "function": c}
                                       for c in m["tool_calls"]]}
                  if m.get("tool_calls") else m for m in conversation]
        return native, [t.as_openai() for t in tools] or None
    out = []
    for m in conversation:
        calls = m.get("tool_calls")
        if calls:
            written = fmt.write_calls(calls) if fmt is not None else "".join(
                json.dumps(c, ensure_ascii=False) for c in calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + written
        out.append(m)
    if tools and fmt is not None:
        described = fmt.describe([t.as_openai()["function"] for t in tools])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None
