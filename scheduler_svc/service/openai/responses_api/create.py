"""POST /v1/responses: the conversation (a stored previous response's, then `input`) after
`instructions`, through the chat template with the request's tools, generated as one choice
and answered as a response object, or streamed as typed events (events.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from batchwire.v1 import generate_pb2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls import (
    ParsedReply,
    ReplyReader,
    ToolCall,
    ToolPlan,
    ToolSpec,
    read_reply,
)
from scheduler_svc.core.tool_calls import plan_tools as plan
from scheduler_svc.service.generation_request import prompt_token_ids
from scheduler_svc.service.openai.context import Admitted, FrontContext
from scheduler_svc.service.openai.errors import as_body
from scheduler_svc.service.openai.responses_api import events
from scheduler_svc.service.openai.responses_api.items import (
    Turn,
    chat_messages,
    input_turns,
    item_id,
    output_items,
    reply_turn,
)
from scheduler_svc.service.openai.responses_api.request import ResponsesRequest
from scheduler_svc.service.openai.responses_api.store import ResponseStore
from scheduler_svc.service.openai.sampling import put
from scheduler_svc.service.openai.sse import EventStream, until_disconnected
from scheduler_svc.service.openai.streams import UsageTotal, merged
from scheduler_svc.service.tool_wire import constrain

NAMES = {"token_ids": "input", "max_tokens": "max_output_tokens", "json_object": "text.format"}


def _tool_plan(body: ResponsesRequest, ctx: FrontContext) -> ToolPlan:
    given = body.tool_choice
    choice, function = (given, None) if given is None or isinstance(given, str) \
        else ("function", given.name)
    specs = [ToolSpec(t.name, t.description, t.parameters, bool(t.strict))
             for t in body.tools or ()]
    return plan(specs, choice, function, ctx.model().tool_format, "tools[{}]",
                body.parallel_tool_calls is not False)


async def _constraint(body: ResponsesRequest, tools: ToolPlan, sampling: Any) -> None:
    """text.format's constraint, or the tools' (a request has one)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        sampling.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequestError("text.format.schema", "type json_schema needs a schema")
        sampling.json_schema = json.dumps(fmt.schema_)
    await constrain(tools, sampling, "text.format")


async def create(body: ResponsesRequest, request: Request, ctx: FrontContext,
                 store: ResponseStore) -> Response:
    m = ctx.model()
    model = ctx.check_model(body.model)
    turns: list[Turn] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise InvalidRequestError("previous_response_id", f"no stored response "
                                      f"{body.previous_response_id!r} (store: false, expired, "
                                      "or made before this server started)")
        turns = list(stored)
    turns += input_turns(body.input)
    if not turns:
        raise InvalidRequestError("input", "nothing given (an empty list)")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = _tool_plan(body, ctx)
    msg = generate_pb2.GenerateRequest(messages=chat_messages(system + turns))
    ids = await prompt_token_ids(msg, m, tools)
    sampling = generate_pb2.SamplingParams()
    max_tokens = body.max_output_tokens
    if max_tokens is None:  # the rest of the context, as the chat API
        max_tokens = max(m.max_model_len - len(ids), 1)
    put(sampling, "max_tokens", max_tokens, "max_output_tokens")
    for field in ("temperature", "top_p"):
        if getattr(body, field) is not None:
            put(sampling, field, getattr(body, field))
    await _constraint(body, tools, sampling)
    response_id = item_id("resp")
    names = {**NAMES, "json_schema": "tools" if tools.constrained else "text.format",
             "grammar": "tools"}
    admitted = await ctx.admit(response_id, ids, sampling, names)
    head = _head(body, response_id, model)
    finish = partial(_finished, body, head, turns, store)
    if body.stream:
        return EventStream(_events(admitted, head, tools, finish), admitted.release,
                           partial(events.framed, failed=_failed))
    try:
        text, reason, usage = await until_disconnected(request, _collect(admitted))
    finally:
        admitted.release()
    reply = read_reply(tools, text)
    return JSONResponse(finish(output_items(reply), reply, reason, usage))


def _head(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else None
    choice = body.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "text": text or {"format": {"type": "text"}}, "store": body.store,
        "metadata": body.metadata or {}, "usage": None, "user": body.user,
    }


def _finished(body: ResponsesRequest, head: dict[str, Any], turns: list[Turn],
              store: ResponseStore, items: list[dict[str, Any]], reply: ParsedReply,
              reason: str, usage: UsageTotal) -> dict[str, Any]:
    """The completed response, stored for previous_response_id unless store is false."""
    if body.store:
        store.put(head["id"], [*turns, reply_turn(reply)])
    counts = usage.as_dict()
    cut = reason == "length"
    return {**head, "status": "incomplete" if cut else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": counts["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens":
                                               counts["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens": counts["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": counts["total_tokens"]}}


async def _collect(admitted: Admitted) -> tuple[str, str, UsageTotal]:
    usage, texts, reason = UsageTotal(1), [], "stop"
    async for _, msg in merged([admitted]):
        texts.append(msg.text)
        usage.update(0, msg)
        if msg.HasField("finish_reason"):
            reason = msg.finish_reason
    return "".join(texts), reason, usage


async def _events(admitted: Admitted, head: dict[str, Any], tools: ToolPlan, finish: Any
                  ) -> AsyncIterator[dict[str, Any]]:
    out = events.OutputEvents()
    yield out.event("response.created", response=head)
    yield out.event("response.in_progress", response=head)
    reader, usage, reason = ReplyReader(tools), UsageTotal(1), "stop"
    async for _, msg in merged([admitted]):
        usage.update(0, msg)
        for e in out.deltas(reader.feed(msg.text)):
            yield e
        if msg.HasField("finish_reason"):
            reason = msg.finish_reason
    for e in out.deltas(reader.finish()):
        yield e
    for e in out.close():
        yield e
    calls = [ToolCall(i["call_id"], i["name"], i["arguments"]) for i in out.items
             if i["type"] == "function_call"]
    text = "".join(i["content"][0]["text"] for i in out.items if i["type"] == "message")
    reply = ParsedReply(text or None, calls)
    kind = "response.incomplete" if reason == "length" else "response.completed"
    yield out.event(kind, response=finish(out.items, reply, reason, usage))


def _failed(error: BaseException) -> dict[str, Any]:
    _, body = as_body(error)
    detail = body["error"]
    return {"type": "error", "code": detail.get("code"), "message": detail["message"],
            "param": detail.get("param"), "sequence_number": 0}

