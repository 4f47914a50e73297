"""The FastAPI application: routes, the API-key check, and OpenAI-shaped errors everywhere.

Open without a key: /health, /version, /metrics (also served keyless on the metrics port) and
the API's description (/openapi.json, /docs). Every other route needs `Authorization: Bearer
<key>` when the server has --api-key-file, with the keys the gRPC API takes.
"""

from __future__ import annotations

from typing import Annotated, Any

from batchwire.v1 import generate_pb2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.engine.replicas import NO_WORKER
from scheduler_svc.service import wire
from scheduler_svc.service.generation_request import tokenized
from scheduler_svc.service.openai import chat, completions, embeddings, errors, responses
from scheduler_svc.service.openai.body import BoundedRoute
from scheduler_svc.service.openai.chat import template_messages
from scheduler_svc.service.openai.context import FrontContext
from scheduler_svc.service.openai.errors import OpenAIError
from scheduler_svc.service.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from scheduler_svc.service.openai.responses_api import create as responses_api
from scheduler_svc.service.openai.responses_api.request import ResponsesRequest
from scheduler_svc.service.openai.responses_api.store import ResponseStore

_bearer = HTTPBearer(auto_error=False, description="a key from the server's --api-key-file")


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": responses.ErrorResponse} for s in statuses}


ERRORS = _errors(400, 401, 404, 413, 429, 503)
# OpenAPI links: what a response gives the next request (fuzzers follow them, e.g. schemathesis's
# stateful runs: the tokens /tokenize returns go to /detokenize, a listed model to a completion).
_MODEL = "$response.body#/data/0/id"
MODEL_LINKS: dict[int | str, dict[str, Any]] = {200: {"links": {
    "complete": {"operationId": "create_completion", "requestBody": {"model": _MODEL}},
    "chat": {"operationId": "create_chat_completion", "requestBody": {"model": _MODEL}},
    "tokenize": {"operationId": "tokenize", "requestBody": {"model": _MODEL}}}}}
TOKEN_LINKS: dict[int | str, dict[str, Any]] = {200: {"links": {
    "detokenize": {"operationId": "detokenize",
                   "requestBody": {"tokens": "$response.body#/tokens"}},
    "complete": {"operationId": "create_completion",
                 "requestBody": {"prompt": "$response.body#/tokens"}}}}}


def context(request: Request) -> FrontContext:
    ctx: FrontContext = request.app.state.front
    return ctx


async def authorize(request: Request, credentials: Annotated[
        HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    keys = context(request).api_keys
    if keys is None:
        return
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise OpenAIError(401, "missing API key: send the header `Authorization: Bearer <key>`")
    if not keys.check(credentials.credentials):
        raise OpenAIError(401, "invalid API key", code="invalid_api_key")


def build_app(front: FrontContext) -> FastAPI:
    app = FastAPI(title="batchwire", version=front.version,
                  description="OpenAI-compatible HTTP API of a batchwire scheduler")
    app.state.front = front
    app.state.responses = ResponseStore()  # previous_response_id's conversations
    errors.install(app)
    api = APIRouter(dependencies=[Depends(authorize)], responses=ERRORS,
                    route_class=BoundedRoute)

    @api.get("/v1/models", response_model=responses.ModelList, operation_id="list_models",
             responses=MODEL_LINKS)
    async def list_models(request: Request) -> JSONResponse:
        ctx = context(request)
        m = ctx.model()
        cards = [{"id": name, "object": "model", "created": ctx.started, "owned_by": "batchwire",
                  "max_model_len": m.max_model_len, "root": m.model_name, "weights": m.weights}
                 for name in ctx.names()]
        cards += [{"id": lora.lora_name, "object": "model", "created": ctx.started,
                   "owned_by": "batchwire", "max_model_len": m.max_model_len,
                   "root": lora.lora_path, "parent": ctx.names()[0]}
                  for lora in m.loras.listed()]
        return JSONResponse({"object": "list", "data": cards})

    # LoRA adapters at run time, as vLLM's routes: 200 with a line of text; a bad name, path or
    # adapter config 400 naming the field; an unload of a name not loaded 404.
    @api.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        lora = context(request).model().loras.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        context(request).model().loras.unload(body.lora_name, body.lora_path or "")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @api.post("/v1/completions", response_model=responses.CompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}},
              operation_id="create_completion")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request, generating(context(request)))

    @api.post("/v1/chat/completions", response_model=responses.ChatCompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}},
              operation_id="create_chat_completion")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request, generating(context(request)))

    @api.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}}}},
              operation_id="create_response")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.create(body, request, generating(context(request)),
                                          request.app.state.responses)

    @api.post("/v1/embeddings", response_model=responses.EmbeddingResponse)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> JSONResponse:
        return await embeddings.create(body, context(request))

    @api.post("/tokenize", response_model=responses.TokenizeResponse, operation_id="tokenize",
              responses=TOKEN_LINKS)
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        ctx = context(request)
        m = ctx.model()
        ctx.check_model(body.model)
        msg = generate_pb2.TokenizeRequest()
        if body.prompt is not None:
            msg.text = body.prompt
        if body.messages:
            msg.messages.extend(template_messages(body.messages))
        if body.add_special_tokens is not None:
            msg.add_special_tokens = body.add_special_tokens
        # Bounded like a generation prompt: refused by its characters before the tokenizer
        # spends seconds on it, tokenized off the event loop when long, and refused when its
        # tokens cannot fit max_model_len.
        try:
            wire.check_prompt_chars(msg, m.max_prompt_chars, m.max_model_len)
            _, ids = await tokenized(msg, m.tokenizer, body.add_special_tokens)
        except InvalidRequestError as e:
            raise errors.renamed(e, {"text": "prompt"}) from None
        if len(ids) > m.max_model_len:
            raise InvalidRequestError("messages" if body.messages else "prompt", f"{len(ids)} "
                                      f"tokens are more than max_model_len={m.max_model_len}")
        return JSONResponse({"count": len(ids), "max_model_len": m.max_model_len,
                             "tokens": ids})

    @api.post("/detokenize", response_model=responses.DetokenizeResponse,
              operation_id="detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        ctx = context(request)
        m = ctx.model()
        ctx.check_model(body.model)
        if len(body.tokens) > m.max_model_len:
            raise InvalidRequestError("tokens", f"{len(body.tokens)} tokens are more than "
                                      f"max_model_len={m.max_model_len}")
        msg = generate_pb2.DetokenizeRequest()
        try:
            msg.token_ids.extend(body.tokens)
            text = wire.detokenize(msg, m.tokenizer, m.vocab_size)
        except ValueError as e:  # protobuf's own refusal of an int32 out of range, too
            message = e.message if isinstance(e, InvalidRequestError) else str(e)
            raise InvalidRequestError("tokens", message) from None
        return JSONResponse({"prompt": text})

    @api.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        """The tokenizer's special tokens and chat template (lm-eval's remote tokenizer)."""
        m = context(request).model()
        t = m.tokenizer
        return JSONResponse({"eos_token": t.eos_token, "bos_token": t.bos_token,
                             "pad_token": t.pad_token, "chat_template": t.chat_template,
                             "model_max_length": m.max_model_len,
                             "tokenizer_class": type(t).__name__})

    app.include_router(api)

    @app.get("/health", responses={503: {"description": "not serving, and why"}})
    async def health(request: Request) -> Response:
        """200 while the gRPC health service says SERVING; 503 otherwise, with an error object
        saying why (loading, draining, no worker)."""
        ctx = context(request)
        if await ctx.serving():
            return Response(status_code=200)
        return JSONResponse(errors.body(503, _not_serving_reason(ctx.servicer)), 503)

    @app.get("/version", response_model=responses.VersionResponse)
    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": context(request).version})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(context(request).metrics_registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def generating(ctx: FrontContext) -> FrontContext:
    """ctx, when its model generates; the gRPC admission's refusal names RPCs (Embed), so an
    embedding server is refused here in HTTP's words."""
    if ctx.model().task != "generate":
        raise errors.OpenAIError(400, errors.WRONG_TASK_GENERATE, "model", "wrong_task")
    return ctx


def _not_serving_reason(servicer: Any) -> str:
    if servicer.draining:
        return ("not serving: the server is stopping; it finishes the requests in flight and "
                "admits no new one")
    if servicer.model is None:
        return ("not serving yet: the model is still loading (or, for `batchwire scheduler`, "
                "no worker has joined yet)")
    return "not serving: " + NO_WORKER
