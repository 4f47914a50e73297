"""Errors as OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`.

Which status an engine error gets is decided once, in service/status_codes.py (as a gRPC code);
here that code becomes its HTTP status, so the two APIs can never disagree about an error.
A field an error names is renamed to the HTTP field the client sent (`sampling.top_p` -> `top_p`,
`token_ids` -> `prompt` ...).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from scheduler_svc.core.errors import InvalidRequestError, WrongTaskError
from scheduler_svc.service.lora_adapters import UnknownAdapterError
from scheduler_svc.service.status_codes import status_for

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,  # e.g. chat on an embedding server
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.NOT_FOUND: 404,  # a LoRA adapter not loaded
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,  # the waiting queue is full
    grpc.StatusCode.UNAVAILABLE: 503,  # loading, draining, no worker left
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}
_CODES = {429: "queue_full", 503: "service_unavailable"}
WRONG_TASK_GENERATE = ("this server runs an embedding model (--task embed), which generates no "
                       "text: use /v1/embeddings here, or serve a generation model (`batchwire "
                       "serve` without --task embed)")


class OpenAIError(Exception):
    """An error the HTTP front itself raises, with its status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def body(status: int, message: str, param: str | None = None,
         code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code or _CODES.get(status)}}


def as_body(error: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error object) for any error a handler meets."""
    if isinstance(error, OpenAIError):
        return error.status, body(error.status, error.message, error.param, error.code)
    if isinstance(error, WrongTaskError):
        # The gRPC words name RPCs (Generate, Embed). /v1/embeddings checks its own task, so
        # here a generation route met an embedding server.
        return 400, body(400, WRONG_TASK_GENERATE, "model", "wrong_task")
    code, message = status_for(error)  # logs an unexpected error
    status = _HTTP_STATUS.get(code, 500)
    param = error.field if isinstance(error, InvalidRequestError) else None
    return status, body(status, message, param)


_LEADING_NAME = re.compile(r"^[A-Za-z_]+")


def renamed(error: InvalidRequestError, names: Mapping[str, str]) -> InvalidRequestError:
    """The admission path's error, naming the HTTP field: the `sampling.` prefix goes, and the
    leading name is looked up in names (the request's own spelling), e.g. `logprobs` ->
    `top_logprobs` in a chat request."""
    # "token_ids (prompt)": the engine's own name in brackets means nothing to an HTTP client.
    field = error.field.removeprefix("sampling.").split(" (")[0]
    match = _LEADING_NAME.match(field)
    if match:
        field = names.get(match.group(), match.group()) + field[match.end():]
    return InvalidRequestError(field, error.message)


def _param(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not text:
            text = str(part)
        elif not str(part).startswith(("str", "list[", "int", "dict[", "function-")):
            text += f".{part}"  # pydantic's union-branch names are not fields
    return text or "body"


def _most_specific(errors: Sequence[Any]) -> Any:
    """The error to report: of a union (`prompt` is a string, or a list of ids, or ...), the
    branch whose type matched but whose value did not (`prompt[0]` out of range), else the first."""
    if not errors:
        return {"loc": (), "msg": "invalid body"}
    for error in errors:
        if not str(error.get("type", "")).endswith(("_type", "_parsing")):
            return error
    return errors[0]


def install(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object: ours, FastAPI's (404 route, 405 method, a
    body of the wrong types) and the engine's."""

    async def validation(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestValidationError)
        first = _most_specific(e.errors())
        loc = tuple(first.get("loc", ()))
        content_type = request.headers.get("content-type", "")
        if loc == ("body",) and "json" not in content_type:
            # FastAPI reads JSON only when told: curl -d sends a form's content type.
            message = (f"the body is not read as JSON: it came as {content_type or 'no type'!r}; "
                       "send it with `Content-Type: application/json`")
            return JSONResponse(body(400, message, "body"), 400)
        param = _param(loc)
        return JSONResponse(body(400, f"{param}: {first.get('msg')}", param), 400)

    async def http(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, HTTPException)
        # BodyError (body.py) names the field it refused.
        return JSONResponse(body(e.status_code, str(e.detail), getattr(e, "param", None)),
                            e.status_code, headers=getattr(e, "headers", None))

    async def engine(request: Request, e: Exception) -> JSONResponse:
        status, content = as_body(e)
        return JSONResponse(content, status)

    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    for kind in (OpenAIError, ValueError, RuntimeError, UnknownAdapterError):
        app.add_exception_handler(kind, engine)
