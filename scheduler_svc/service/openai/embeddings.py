"""POST /v1/embeddings, on a server whose workers run a pooling model: the inputs become one
EmbedRequest, run by the Generation service's own Embed path (service/embed.py)."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from batchwire.v1 import generate_pb2
from fastapi.responses import JSONResponse

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.service.embed import embed
from scheduler_svc.service.openai.context import FrontContext
from scheduler_svc.service.openai.errors import OpenAIError
from scheduler_svc.service.openai.protocol import EmbeddingRequest, as_batch
from scheduler_svc.service.openai.sampling import put


def embed_request(body: EmbeddingRequest) -> generate_pb2.EmbedRequest:
    msg = generate_pb2.EmbedRequest(request_id=f"embd-{uuid.uuid4().hex}")
    inputs = as_batch(body.input, "input")
    if isinstance(inputs[0], str):
        put(msg, "texts", list(inputs), "input")
    else:
        for ids in inputs:
            put(msg.token_ids.add(), "ids", list(ids), "input")
    if body.dimensions is not None:
        put(msg, "dimensions", body.dimensions)
    return msg


async def create(body: EmbeddingRequest, ctx: FrontContext) -> JSONResponse:
    m = ctx.model()
    model = ctx.check_model(body.model)
    if m.task != "embed":
        raise OpenAIError(400, f"this server runs a {m.task!r} model, which makes no "
                          "embeddings: use /v1/completions or /v1/chat/completions here, or "
                          "serve an embedding model with `batchwire serve --task embed`",
                          "model", "wrong_task")
    try:
        reply = await embed(m.engine, m.tokenizer, m.task, embed_request(body))
    except InvalidRequestError as e:
        field = e.field.replace("texts", "input").replace("token_ids", "input")
        raise InvalidRequestError(field, e.message) from None
    data = []
    for item in reply.embeddings:
        vector: list[float] | str = list(item.values)
        if body.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(item.values, "<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": item.index, "embedding": vector})
    tokens = reply.usage.prompt_tokens
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
