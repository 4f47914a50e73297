"""API keys for the client API: one interceptor checks `authorization: Bearer <key>` on every RPC.

Deny by default: every service on the port needs a key except health checking and reflection,
which probes, load balancers and grpcurl use without one. A missing or wrong key ends the call
with UNAUTHENTICATED before the servicer sees the request.

Keys come from a file, one per line, read again when it changes and compared in constant time
(batchwire.common.key_file, which the worker's token uses too).

TLS credentials live in batchwire.common.tls (the workers use them too); re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from batchwire.common.key_file import KeyFile, bearer_token, parse_keys
from batchwire.common.tls import ClientTls, ServerTls, add_port, channel, start_health_server

logger = logging.getLogger(__name__)

# Services a caller reaches without a key.
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})


class ApiKeys(KeyFile):
    """The client API's accepted keys (`--api-key-file`)."""

    what = "API key"


def _service(method: str) -> str:
    """'/batchwire.v1.Generation/Generate' -> 'batchwire.v1.Generation'."""
    return method.lstrip("/").partition("/")[0]


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that ends the call with UNAUTHENTICATED."""

    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, open_services: Iterable[str] = OPEN_SERVICES) -> None:
        self.keys = keys
        self.open_services = frozenset(open_services)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or _service(details.method) in self.open_services:
            return handler
        token = bearer_token(details.invocation_metadata)
        if token is None:
            return _refusal(handler, "missing API key: send the metadata "
                            "`authorization: Bearer <key>`")
        if not self.keys.check(token):
            return _refusal(handler, "invalid API key")
        return handler


def interceptors(api_key_file: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The client API's interceptors for the given options (none without a key file)."""
    return [ApiKeyInterceptor(ApiKeys.from_file(api_key_file))] if api_key_file else []


__all__ = ["ApiKeyInterceptor", "ApiKeys", "ClientTls", "OPEN_SERVICES", "ServerTls",
           "add_port", "bearer_token", "channel", "interceptors", "parse_keys",
           "start_health_server"]
