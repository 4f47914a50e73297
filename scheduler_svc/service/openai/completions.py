"""POST /v1/completions: one or more prompts (text or token ids), n choices each.

Choice index = prompt index * n + sequence index, as OpenAI numbers them. `echo` puts the prompt
(as run) in front of each choice's text; with `logprobs` it also asks for prompt logprobs, the
first prompt token scored None. `max_tokens: 0` with echo is the log-likelihood request of
evaluation harnesses: the prompt runs with max_tokens 1 and the sampled token is dropped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from batchwire.v1 import generate_pb2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from scheduler_svc.service.generation_request import prompt_token_ids
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.openai.context import Admitted, FrontContext
from scheduler_svc.service.openai.errors import OpenAIError
from scheduler_svc.service.openai.logprobs import CompletionLogprobs, TokenText
from scheduler_svc.service.openai.protocol import CompletionRequest, as_batch
from scheduler_svc.service.openai.sampling import sampling_message
from scheduler_svc.service.openai.sse import EventStream, until_disconnected
from scheduler_svc.service.openai.streams import UsageTotal, merged

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
# Admission's field names, as this endpoint's client spelled them.
NAMES = {"token_ids": "prompt", "text": "prompt", "prompt_logprobs": "logprobs",
         "json_schema": "response_format", "json_object": "response_format"}


async def prompts(prompt: Any, m: LoadedModel) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, tokenized as Generate tokenizes text."""
    out: list[tuple[str | None, list[int]]] = []
    for p in as_batch(prompt, "prompt"):
        if isinstance(p, str):
            out.append((p, await prompt_token_ids(generate_pb2.GenerateRequest(text=p), m)))
            await asyncio.sleep(0)  # short prompts tokenize on the loop: let others in between
        else:
            out.append((None, list(p)))
    return out


class Choice:
    def __init__(self, index: int, echo: str, logprobs: CompletionLogprobs | None) -> None:
        self.index = index
        self.parts = [echo] if echo else []
        self.logprobs = logprobs
        self.sent_logprobs = 0  # entries already streamed
        self.finish_reason: str | None = None

    def feed(self, msg: generate_pb2.GenerateResponse, drop_output: bool) -> str:
        """Takes a message; returns the text it adds (streaming sends just that)."""
        if self.logprobs is not None:
            self.logprobs.add(msg.prompt_logprobs)
            if not drop_output:
                self.logprobs.add(msg.logprobs)
        added = "" if drop_output else msg.text
        if added:
            self.parts.append(added)
        if msg.HasField("finish_reason"):
            self.finish_reason = msg.finish_reason
        return added

    def as_dict(self) -> dict[str, Any]:
        lp = self.logprobs.as_dict() if self.logprobs is not None else None
        return {"index": self.index, "text": "".join(self.parts), "logprobs": lp,
                "finish_reason": self.finish_reason}


async def create(body: CompletionRequest, request: Request, ctx: FrontContext) -> Response:
    m = ctx.model()
    model = ctx.check_model(body.model)
    if body.suffix:
        raise OpenAIError(400, "suffix: not supported (no fill-in-the-middle model)", "suffix")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise OpenAIError(400, f"best_of: only best_of = n ({n}) is supported", "best_of")
    drop_output = body.echo and body.max_tokens == 0
    max_tokens = (1 if drop_output else
                  DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens)
    prompt_logprobs = body.logprobs if body.echo else None
    sampling = sampling_message(body, max_tokens, body.logprobs, prompt_logprobs)
    given = await prompts(body.prompt, m)
    base = f"cmpl-{uuid.uuid4().hex}"
    request_ids = [base] if len(given) == 1 else [f"{base}-{i}" for i in range(len(given))]
    admitted = await ctx.admit_all(request_ids, [ids for _, ids in given], sampling, NAMES,
                                   body.priority, body.cache_salt, ctx.lora_name(model))
    text_of = TokenText(m.tokenizer)

    def choice(i: int, j: int) -> Choice:
        a, (text, _) = admitted[i], given[i]
        echo = ""
        if body.echo:
            echo = text if text is not None and a.prompt_ids == given[i][1] else \
                m.tokenizer.decode(a.prompt_ids, skip_special_tokens=False)
        lp = None
        if body.logprobs is not None:
            lp = CompletionLogprobs(text_of)
            if body.echo and a.prompt_ids:
                lp.add_unscored(a.prompt_ids[0])
        return Choice(i * n + j, echo, lp)

    head = {"id": base, "object": "text_completion", "created": int(time.time()),
            "model": model}
    usage = UsageTotal(len(admitted), count_completion=not drop_output)
    if body.stream:
        options = body.stream_options
        return EventStream(_chunks(admitted, head, choice, usage, drop_output, options),
                           lambda: _release(admitted))
    try:
        choices = await until_disconnected(request, _collect(admitted, choice, usage,
                                                             drop_output))
    finally:
        _release(admitted)
    return JSONResponse({**head, "choices": [c.as_dict() for c in choices],
                         "usage": usage.as_dict()})


def _release(admitted: list[Admitted]) -> None:
    for a in admitted:
        a.release()


async def _collect(admitted: list[Admitted], choice: Any, usage: UsageTotal,
                   drop_output: bool) -> list[Choice]:
    choices: dict[int, Choice] = {}
    n = len(admitted[0].streams)
    async for i, msg in merged(admitted):
        c = choices.get(i * n + msg.index)
        if c is None:
            c = choices[i * n + msg.index] = choice(i, msg.index)
        c.feed(msg, drop_output)
        usage.update(i, msg)
    return [choices[k] for k in sorted(choices)]


async def _chunks(admitted: list[Admitted], head: dict[str, Any], choice: Any,
                  usage: UsageTotal, drop_output: bool, options: Any
                  ) -> AsyncIterator[dict[str, Any]]:
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    choices: dict[int, Choice] = {}
    n = len(admitted[0].streams)
    async for i, msg in merged(admitted, continuous):
        key = i * n + msg.index
        c = choices.get(key)
        first = c is None
        if c is None:
            c = choices[key] = choice(i, msg.index)
        added = c.feed(msg, drop_output)
        usage.update(i, msg)
        text = "".join(c.parts) if first else added
        lp = None
        if c.logprobs is not None:
            lp, c.sent_logprobs = c.logprobs.as_dict(c.sent_logprobs), len(c.logprobs)
        if not text and not msg.HasField("finish_reason") and not (lp and lp["tokens"]):
            continue  # text held back (a possible stop string): nothing to say yet
        chunk = {**head, "choices": [{"index": key, "text": text, "logprobs": lp,
                                      "finish_reason": c.finish_reason}]}
        if continuous:
            chunk["usage"] = usage.as_dict()
        elif include_usage:
            chunk["usage"] = None
        yield chunk
    if include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}
