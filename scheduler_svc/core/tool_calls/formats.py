"""The tool-call syntaxes of the chat templates batchwire serves, and which one a template uses.

- smollm2: `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`, a JSON list in one
  tag (SmolLM2's documented function-calling prompt; the embedded model's template names no
  tools, so they are described in a system message).
- hermes: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call (Hermes,
  Qwen2.5, Qwen3; their templates render `tools` themselves).
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (calls separated by
  `;`), possibly after `<|python_tag|>` (Llama 3.1 to 3.3).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    open_tag: str  # what opens a call anywhere in the reply
    close_tag: str | None  # None: a call runs to the end of the reply
    bare_json_at_start: bool  # a reply that starts with `{` is a call
    argument_key: str  # what the format calls a call's arguments

    def describe(self, tools: list[dict[str, Any]]) -> str:
        """A system message's text telling the model the tools and how to call them, for
        templates that do not render `tools` themselves. The JSON is spaced as the model
        writes it: compact, SmolLM2-135M misnames a tool ("weather" for "get_weather")."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = json.dumps({"name": "<function name>", self.argument_key: {"<parameter>":
                                                                             "<value>"}})
        if self.name == "smollm2":
            how = (f"To call functions, answer with <tool_call>[{example}]</tool_call>, a JSON "
                   "list of one or more calls and nothing else. If no function fits, answer "
                   "in plain text.")
        elif self.name == "hermes":
            how = (f"To call a function, answer with <tool_call>{example}</tool_call>, one tag "
                   "per call. If no function fits, answer in plain text.")
        else:
            how = (f"To call a function, answer with only the JSON {example}. If no function "
                   "fits, answer in plain text.")
        return f"You can call these functions:\n<tools>\n{listed}\n</tools>\n{how}"

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        """An earlier assistant turn's calls ({"name", "arguments"}) as this format writes
        them, so that the conversation shows the model its own syntax."""
        objects = [{"name": c["name"], self.argument_key: c["arguments"]} for c in calls]
        if self.name == "smollm2":
            return f"<tool_call>{json.dumps(objects, ensure_ascii=False)}</tool_call>"
        if self.name == "hermes":
            return "".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>"
                           for o in objects)
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objects)


FORMATS = {f.name: f for f in (
    ToolCallFormat("smollm2", "<tool_call>", "</tool_call>", False, "arguments"),
    ToolCallFormat("hermes", "<tool_call>", "</tool_call>", False, "arguments"),
    ToolCallFormat("llama3_json", "<|python_tag|>", None, True, "parameters"),
)}


def format_for_template(template: str | None) -> ToolCallFormat | None:
    """The syntax a chat template's model was trained to call tools with, or None when the
    template shows none that batchwire knows."""
    if not template:
        return None
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template
                                         and "tools" in template):
        return FORMATS["llama3_json"]
    if "SmolLM" in template:
        return FORMATS["smollm2"]
    return None


def template_renders_tools(template: str | None) -> bool:
    """Whether the template takes a `tools` variable (and then writes the tool calls of earlier
    turns itself)."""
    return bool(template) and "tools" in str(template)


def choose_format(option: str | None, template: str | None) -> ToolCallFormat | None:
    """--tool-call-parser: a format's name, "none", or None (unset: from the template)."""
    if option is None:
        return format_for_template(template)
    if option == "none":
        return None
    if option not in FORMATS:
        raise ValueError(f"--tool-call-parser: {option!r} is not one of "
                         f"{', '.join([*FORMATS, 'none'])}")
    return FORMATS[option]
