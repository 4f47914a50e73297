"""Tool calls in a model's own syntax: which syntax a chat template uses (formats.py), and the
reply read, whole or as it streams, into text and calls (stream.py, on json_scan.py)."""

from scheduler_svc.core.tool_calls.formats import (
    FORMATS,
    ToolCallFormat,
    choose_format,
    format_for_template,
    template_renders_tools,
)
from scheduler_svc.core.tool_calls.stream import (
    CallDelta,
    Deltas,
    ParsedReply,
    ToolCall,
    ToolCallStream,
    parse,
)

__all__ = [
    "FORMATS", "CallDelta", "Deltas", "ParsedReply", "ToolCall", "ToolCallFormat",
    "ToolCallStream", "choose_format", "format_for_template", "parse", "template_renders_tools",
]
