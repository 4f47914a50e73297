"""API keys for the client API: one interceptor checks `authorization: Bearer <key>` on every RPC.

Deny by default: every service on the port needs a key except health checking and reflection,
which probes, load balancers and grpcurl use without one. A missing or wrong key ends the call
with UNAUTHENTICATED before the servicer sees the request.

Keys come from a file, one per line (blank lines and `#` comments skipped), so that a key can be
rotated by listing old and new together for a while. The file is read again when it changes.
The presented key is compared with every key through hmac.compare_digest of their SHA-256
digests: the time taken depends neither on where the keys first differ nor on their lengths.

TLS credentials live in batchwire.common.tls (the workers use them too); re-exported here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from batchwire.common.tls import ClientTls, ServerTls, add_port, channel, start_health_server

logger = logging.getLogger(__name__)

# Services a caller reaches without a key.
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def parse_keys(text: str) -> list[str]:
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


class ApiKeys:
    """The accepted keys, from a list or from a file that is read again when it changes."""

    def __init__(self, keys: Iterable[str] = (), path: str | None = None) -> None:
        self.path = path
        self._mtime: float | None = None
        self._digests: list[bytes] = [_digest(k) for k in keys]
        if path is not None:
            self._reload(force=True)
        if not self._digests:
            raise ValueError(f"no API key given{f' in {path!r}' if path else ''}: the file "
                             "holds one key per line")

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        return cls(path=path)

    def _reload(self, force: bool = False) -> None:
        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime
            if not force and mtime == self._mtime:
                return
            with open(self.path) as f:
                keys = parse_keys(f.read())
        except OSError as e:
            if force:
                raise ValueError(f"cannot read the API key file {self.path!r}: "
                                 f"{e.strerror}") from None
            logger.warning("keeping the current API keys: %s", e)
            return
        if not keys and not force:
            logger.warning("the API key file %r is empty now: keeping the current keys",
                           self.path)
            return
        self._digests = [_digest(k) for k in keys]
        self._mtime = mtime

    def check(self, presented: str) -> bool:
        if self.path is not None:
            self._reload()
        given = _digest(presented)
        ok = False
        for digest in self._digests:  # no early exit: every key costs the same
            ok |= hmac.compare_digest(given, digest)
        return ok


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The key of the first `authorization: Bearer <key>` entry, or None."""
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


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
           "add_port", "bearer_token", "channel", "interceptors", "start_health_server"]
