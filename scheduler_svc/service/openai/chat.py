"""POST /v1/chat/completions: the conversation through the model's chat template (as Generate
renders `messages`), n choices, logprobs, response_format and tool calls.

Without max_tokens (or max_completion_tokens, which wins) a reply may use the rest of the
context, as vLLM allows. A stream opens each choice with its role, then sends content deltas;
the last chunk of a choice carries its finish_reason. Under tool_choice "auto" a choice's text
goes through a ToolCallStream: plain text as content deltas, each call as its id and name, then
its argument fragments; a constrained call is sent whole at the end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from batchwire.v1 import generate_pb2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls import ToolPlan, read_reply
from scheduler_svc.service.generation_request import prompt_token_ids
from scheduler_svc.service.openai.context import Admitted, FrontContext
from scheduler_svc.service.openai.logprobs import TokenText, chat_logprobs
from scheduler_svc.service.openai.protocol import ChatCompletionRequest, ChatMessage
from scheduler_svc.service.openai.sampling import sampling_message
from scheduler_svc.service.openai.sse import EventStream, until_disconnected
from scheduler_svc.service.openai.streams import UsageTotal, merged
from scheduler_svc.service.openai.tools import StreamedCalls, call_json, tool_plan
from scheduler_svc.service.tool_wire import constrain

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def template_messages(messages: list[ChatMessage]) -> list[generate_pb2.ChatMessage]:
    """OpenAI's messages as Generate's: text parts joined, an assistant's calls and a tool
    result's call id kept (the template, or the tool-call format, writes them)."""
    out = []
    for i, m in enumerate(messages):
        role = ROLES.get(m.role)
        if role is None:
            raise InvalidRequestError(f"messages[{i}].role", f"{m.role!r} is not one of "
                                      f"{', '.join(ROLES)}")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", "only text parts "
                                              f"are supported (got type {part.type!r})")
            text = "\n".join(part.text or "" for part in m.content)
        else:
            text = m.content or ""
        calls = [generate_pb2.ToolCall(id=c.id or "", name=c.function.name,
                                       arguments=c.function.arguments)
                 for c in m.tool_calls or ()]
        out.append(generate_pb2.ChatMessage(role=role, content=text, tool_calls=calls,
                                            tool_call_id=m.tool_call_id or ""))
    return out


def _names(body: ChatCompletionRequest, tools: ToolPlan) -> dict[str, str]:
    names = {"token_ids": "messages", "logprobs": "top_logprobs",
             "json_schema": "tools" if tools.constrained else "response_format",
             "json_object": "response_format", "grammar": "tools"}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


async def create(body: ChatCompletionRequest, request: Request, ctx: FrontContext) -> Response:
    m = ctx.model()
    model = ctx.check_model(body.model)
    if not body.messages:
        raise InvalidRequestError("messages", "no message given")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    tools = tool_plan(body, m.tool_format)
    ids = await prompt_token_ids(
        generate_pb2.GenerateRequest(messages=template_messages(body.messages)), m, tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:  # the rest of the context
        k = body.truncate_prompt_tokens
        run = min(len(ids), k) if k is not None and k > 0 else len(ids)
        max_tokens = max(m.max_model_len - run, 1)  # too long a prompt: admission says so
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = sampling_message(body, max_tokens, logprobs)
    await constrain(tools, sampling, "response_format")
    base = f"chatcmpl-{uuid.uuid4().hex}"
    admitted = await ctx.admit(base, ids, sampling, _names(body, tools), body.priority,
                               body.cache_salt, ctx.lora_name(model))
    state = _Reply(TokenText(m.tokenizer), logprobs, tools)
    head = {"id": base, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    usage = UsageTotal(1)
    if body.stream:
        return EventStream(_chunks(admitted, head, state, usage, body), admitted.release)
    try:
        choices = await until_disconnected(request, _collect(admitted, state, usage))
    finally:
        admitted.release()
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": usage.as_dict()})


class _Reply:
    """How each choice's messages become OpenAI's: text, logprobs, tool calls."""

    def __init__(self, text_of: TokenText, top: int | None, tools: ToolPlan) -> None:
        self.text_of, self.top, self.tools = text_of, top, tools

    def logprobs(self, msg: generate_pb2.GenerateResponse) -> list[dict[str, Any]]:
        return chat_logprobs(msg.logprobs, self.text_of, self.top or 0)

    def finish(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """(the message's content or tool calls, the finish reason)."""
        reply = read_reply(self.tools, text)
        if not reply.calls:
            return {"content": text}, reason
        return ({"content": reply.content, "tool_calls": [call_json(c) for c in reply.calls]},
                "tool_calls")


async def _collect(admitted: Admitted, state: _Reply, usage: UsageTotal
                   ) -> list[dict[str, Any]]:
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {}
    reasons: dict[int, str] = {}
    async for _, msg in merged([admitted]):
        texts.setdefault(msg.index, []).append(msg.text)
        if state.top is not None:
            logprobs.setdefault(msg.index, []).extend(state.logprobs(msg))
        if msg.HasField("finish_reason"):
            reasons[msg.index] = msg.finish_reason
        usage.update(0, msg)
    choices = []
    for i in sorted(texts):
        content, reason = state.finish("".join(texts[i]), reasons.get(i, "stop"))
        lp = {"content": logprobs.get(i, [])} if state.top is not None else None
        choices.append({"index": i, "message": {"role": "assistant", **content},
                        "logprobs": lp, "finish_reason": reason})
    return choices


async def _chunks(admitted: Admitted, head: dict[str, Any], state: _Reply, usage: UsageTotal,
                  body: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    opened: set[int] = set()
    held: dict[int, list[str]] = {}  # a constrained call's text, sent whole at its end
    calls = StreamedCalls(state.tools.fmt) if state.tools.parses else None

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None,
              reason: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": reason}]}
        if continuous:
            out["usage"] = usage.as_dict()
        elif include_usage:
            out["usage"] = None
        return out

    async for _, msg in merged([admitted], continuous):
        usage.update(0, msg)
        i = msg.index
        if i not in opened:
            opened.add(i)
            yield chunk(i, {"role": "assistant", "content": ""})
        lp = {"content": state.logprobs(msg)} if state.top is not None else None
        finished = msg.HasField("finish_reason")
        if calls is not None:
            delta: dict[str, Any] = calls.delta(i, msg.text, finished)
            reason = calls.finish_reason(i, msg.finish_reason) if finished else None
            if delta or finished or (lp is not None and lp["content"]):
                yield chunk(i, delta, lp, reason)
            continue
        if state.tools.constrained:
            held.setdefault(i, []).append(msg.text)
            if finished:
                content, reason = state.finish("".join(held.pop(i)), msg.finish_reason)
                if "tool_calls" in content:
                    content = {"tool_calls": [{"index": 0, **content["tool_calls"][0]}]}
                yield chunk(i, content, lp, reason)
            elif lp is not None and lp["content"]:
                yield chunk(i, {}, lp)
            continue
        if msg.text or finished or (lp is not None and lp["content"]):
            delta = {"content": msg.text} if msg.text else {}
            yield chunk(i, delta, lp, msg.finish_reason if finished else None)
    if include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}
