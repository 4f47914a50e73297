"""A Responses request's input as a conversation (turns), the reply as output items, and turns
as Generate's chat messages.

A turn is a plain dict: {"role", "content"}, with "tool_calls" ([{"id", "name", "arguments"}])
on an assistant turn that called, and "tool_call_id" on a tool result. Consecutive
function_call items are one assistant turn, as a chat message holds parallel calls.
"""

from __future__ import annotations

import uuid
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls import ParsedReply
from scheduler_svc.service.openai.responses_api.request import InputItem

Turn = dict[str, Any]
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_turns(given: str | list[InputItem]) -> list[Turn]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    turns: list[Turn] = []
    for i, item in enumerate(given):
        if item.type == "message":
            if item.role is None:
                raise InvalidRequestError(f"input[{i}].role", "a message needs a role")
            content = item.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            turns.append({"role": ROLES[item.role], "content": content or ""})
        elif item.type == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise InvalidRequestError(f"input[{i}].{field}", "a function_call needs it")
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
                turns[-1]["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            if item.call_id is None or item.output is None:
                raise InvalidRequestError(f"input[{i}]", "a function_call_output needs call_id "
                                                         "and output")
            turns.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return turns


def reply_turn(reply: ParsedReply) -> Turn:
    turn: Turn = {"role": "assistant", "content": reply.content or ""}
    if reply.calls:
        turn["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                              for c in reply.calls]
    return turn


def chat_messages(turns: list[Turn]) -> list[generate_pb2.ChatMessage]:
    return [generate_pb2.ChatMessage(
        role=t["role"], content=t["content"], tool_call_id=t.get("tool_call_id", ""),
        tool_calls=[generate_pb2.ToolCall(**c) for c in t.get("tool_calls", ())])
        for t in turns]


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", id: str | None = None
                 ) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] \
        if status == "completed" else []
    return {"type": "message", "id": id or item_id("msg"), "status": status,
            "role": "assistant", "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": id or item_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(reply: ParsedReply) -> list[dict[str, Any]]:
    items = [message_item(reply.content)] if reply.content else []
    return items + [call_item(c.id, c.name, c.arguments) for c in reply.calls]
