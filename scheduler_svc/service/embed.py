"""Generation.Embed: a batch of inputs in, one vector per input out.

Each input runs as its own engine request (id "<request_id>-<i>"), so the scheduler batches and
chunks them like any prompts; the call returns when the last vector has come. A refused input
aborts the ones already admitted, so a bad batch leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError, WrongTaskError
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.async_engine import RequestStream
from scheduler_svc.service import wire


def inputs(request: generate_pb2.EmbedRequest, tokenizer: Any) -> tuple[str, list[list[int]]]:
    """(the input field the request set, each input's token ids); refuses none, both or empty."""
    if bool(request.texts) == bool(request.token_ids):
        given = "both" if request.texts else "neither"
        raise InvalidRequestError("texts", f"set exactly one of texts and token_ids (got {given})")
    if request.texts:
        ids = [list(tokenizer(text).input_ids) for text in request.texts]
        field = "texts"
    else:
        ids = [list(t.ids) for t in request.token_ids]
        field = "token_ids"
    empty = next((i for i, x in enumerate(ids) if not x), None)
    if empty is not None:
        raise InvalidRequestError(f"{field}[{empty}]", "the input has no tokens")
    return field, ids


def pooling_params(request: generate_pb2.EmbedRequest) -> PoolingParams:
    return PoolingParams(
        normalize=request.normalize if request.HasField("normalize") else None,
        dimensions=request.dimensions if request.HasField("dimensions") else None)


async def embed(engine: Any, tokenizer: Any, task: str,
                request: generate_pb2.EmbedRequest) -> generate_pb2.EmbedResponse:
    if task != "embed":
        raise WrongTaskError(f"Embed: this server runs a {task!r} model; use Generate")
    base = request.request_id or uuid.uuid4().hex
    if len(base) > wire.MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"{len(base)} characters, at most "
                                                f"{wire.MAX_REQUEST_ID_CHARS} allowed")
    # Many or long texts are tokenized on a thread: the tokenizer releases the GIL, so the
    # event loop goes on serving the other streams meanwhile.
    if sum(map(len, request.texts)) > wire.OFF_LOOP_CHARS:
        field, batch = await asyncio.to_thread(inputs, request, tokenizer)
    else:
        field, batch = inputs(request, tokenizer)
    pooling = pooling_params(request)
    # Generation settings do not matter to a pooling step; the defaults pass every check.
    params = SamplingParams()
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(batch):
            try:
                streams.append(await engine.add_request(f"{base}-{i}", ids, params,
                                                        pooling=pooling))
            except InvalidRequestError as e:
                raise _input_error(e, f"{field}[{i}]") from None
        finals = await asyncio.gather(*(_last(s) for s in streams))
    finally:
        for stream in streams:
            stream.close()  # aborts what is still running (a failure, a cancelled call)
    response = generate_pb2.EmbedResponse(request_id=base)
    for i, out in enumerate(finals):
        if out.embedding is None:
            raise RuntimeError(f"input {i} ended ({out.finish_reason}) without a vector")
        response.embeddings.add(index=i, values=out.embedding)
    tokens = sum(len(ids) for ids in batch)
    response.usage.prompt_tokens = response.usage.total_tokens = tokens
    return response


async def _last(stream: RequestStream) -> EngineCoreOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


def _input_error(error: InvalidRequestError, field: str) -> InvalidRequestError:
    """The scheduler's refusal of one input, named by the client's field and index."""
    if error.field in ("prompt", "prompt_token_ids"):
        return InvalidRequestError(field, error.message)
    return error
