"""Requests parsed inside their handler, so that bytes that are not the method's message get
INVALID_ARGUMENT on every service of the scheduler's port.

gRPC runs a handler's request deserializer before the handler, and a deserializer that raises
ends the call with a status the client cannot act on (UNKNOWN or INTERNAL, by version). This
interceptor hands each handler the raw bytes and parses them itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class ParseInHandler(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler  # nothing to parse, or a request stream (none on this port)
        return _parsing(handler)


def _parsing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    message_class = getattr(deserialize, "__self__", None)
    name = getattr(getattr(message_class, "DESCRIPTOR", None), "full_name", "request message")

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # DecodeError, or anything a deserializer may raise
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {name}: {e}")

    serialize = handler.response_serializer
    if handler.response_streaming:
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):
            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                request = await parse(raw, context)
                async for response in inner(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=serialize)

        async def written(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await _result(inner(await parse(raw, context), context))

        return grpc.unary_stream_rpc_method_handler(written, response_serializer=serialize)
    inner = handler.unary_unary

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await _result(inner(await parse(raw, context), context))

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)


async def _result(value: Any) -> Any:
    """A handler may be a coroutine function or a plain one."""
    return await value if inspect.isawaitable(value) else value
