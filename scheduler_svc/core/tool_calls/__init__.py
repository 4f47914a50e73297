"""Tool calls in a model's own syntax: which syntax a chat template uses (formats.py), what a
request's tool_choice asks (choice.py), the tools and earlier calls in the prompt (prompt.py),
what the plan constrains the output to (grammar.py), and the reply read, whole or as it streams,
into text and calls (stream.py, on json_scan.py)."""

from scheduler_svc.core.tool_calls.choice import ToolPlan, ToolSpec, plan_tools
from scheduler_svc.core.tool_calls.formats import (
    FORMATS,
    ToolCallFormat,
    choose_format,
    format_for_template,
    template_renders_tools,
)
from scheduler_svc.core.tool_calls.grammar import tagged_calls, tool_constraint
from scheduler_svc.core.tool_calls.prompt import past_call, tool_conversation
from scheduler_svc.core.tool_calls.reply import ReplyReader, read_reply
from scheduler_svc.core.tool_calls.stream import (
    CallDelta,
    Deltas,
    ParsedReply,
    ToolCall,
    ToolCallStream,
    parse,
)

__all__ = [
    "FORMATS", "CallDelta", "Deltas", "ParsedReply", "ReplyReader", "ToolCall", "ToolCallFormat",
    "ToolCallStream", "ToolPlan", "ToolSpec", "choose_format", "format_for_template", "parse",
    "past_call", "plan_tools", "read_reply", "tagged_calls", "template_renders_tools",
    "tool_constraint", "tool_conversation",
]
