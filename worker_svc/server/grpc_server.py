"""The Worker service over gRPC (grpc.aio), with health checking and reflection.

Requests reach WorkerServicer.call() as raw bytes (no deserializer on the handler), so a request
that does not parse gets INVALID_ARGUMENT from the servicer, as on ZMQ, rather than gRPC's INTERNAL.
Model work runs on the model thread; the event loop stays free to answer health checks.
The worker token travels as `authorization: Bearer <token>` call metadata, as API keys do.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import grpc
from batchwire.common.key_file import bearer_token
from batchwire.common.tls import ServerTls, add_port, start_health_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from worker_svc.server.servicer import SERVICE_NAME, WorkerCallError, WorkerServicer

MAX_MESSAGE_BYTES = 256 << 20  # a full prefill step of long prompts is megabytes

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # The scheduler pings every second to notice a frozen worker; let it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]




def _unary(servicer: WorkerServicer, method: str, model_thread: Executor):
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            servicer.authorize(bearer_token(context.invocation_metadata()))
            parsed = servicer.parse(method, request)
            # NOTE: every call runs on the model thread, the one that loaded the model, even a
            # short one the event loop could run for less than the ~75 us hop: torch work split
            # over two threads' OpenMP teams made W64's steps ~25% slower on 2 cores.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(model_thread, servicer.run, method, parsed)
        except WorkerCallError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("unreachable: abort raises") from e

    return grpc.unary_unary_rpc_method_handler(handle)  # bytes in, bytes out


class GrpcWorkerServer:
    def __init__(self, servicer: WorkerServicer, model_thread: Executor) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        handlers = {m: _unary(servicer, m, model_thread) for m in servicer.methods}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        self.port = 0
        self.health_server = None

    async def start(self, host: str, port: int, tls: ServerTls | None = None) -> int:
        """Binds (port 0 = any free port) and serves, NOT_SERVING until set_serving(True).
        With tls the port speaks TLS only (mutual TLS when tls names a client CA)."""
        await self.set_serving(False)
        self.port = add_port(self.server, f"{host}:{port}", tls)
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {host}:{port}")
        await self.server.start()
        return self.port

    async def start_health_port(self, host: str, port: int) -> int:
        """Health checks alone, in plaintext, for probes that cannot speak TLS."""
        self.health_server, bound = await start_health_server(self.health, host, port)
        return bound

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
