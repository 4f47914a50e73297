"""The executor over gRPC: one channel per rank, requests serialized once and sent as bytes.

A dead worker fails its call at once (the connection drops); a frozen one is caught by HTTP/2
keepalive pings and by the watcher's health checks, both within a few heartbeat periods.
"""

from __future__ import annotations

import time

import grpc
from batchwire.common import tls
from batchwire.common.key_file import bearer_metadata
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.executors.errors import WorkerError, WorkerUnavailableError
from scheduler_svc.executors.remote import Call, Outcome, RemoteExecutor

SERVICE = "batchwire.v1.Worker"
MAX_MESSAGE_BYTES = 256 << 20


def channel_options(heartbeat_s: float) -> list[tuple[str, int]]:
    ms = max(100, int(heartbeat_s * 1000))
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", 2 * ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),  # a step is not idempotent
    ]


class DoneCall(Call):
    def __init__(self, outcomes: list[Outcome]) -> None:
        self.outcomes = outcomes

    def wait(self) -> list[Outcome]:
        return self.outcomes


class GrpcCall(Call):
    def __init__(self, futures: list[grpc.Future], addresses: list[str],
                 executor: GrpcExecutor) -> None:
        self.futures = futures
        self.addresses = addresses
        self.executor = executor

    def wait(self) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for rank, future in enumerate(self.futures):
            try:
                outcomes.append(future.result())
            except grpc.FutureCancelledError:
                self.executor.check_alive()
                raise WorkerUnavailableError("the call was cancelled", rank,
                                             self.addresses[rank]) from None
            except grpc.RpcError as e:
                outcomes.append(WorkerError(e.code(), e.details() or "", rank,
                                            self.addresses[rank]))
        return outcomes

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()

    def ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for future in self.futures:
            if future.done():
                continue
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                return False
            except grpc.FutureCancelledError:
                pass  # in: wait() says why
        return True


class GrpcExecutor(RemoteExecutor):
    transport = "grpc"

    def _connect(self) -> None:
        options = channel_options(self.config.worker_heartbeat_s)
        self.channels = [tls.channel(a, self.config.worker_tls, options) for a in self.addresses]
        timeout, heartbeat = self.config.worker_rpc_timeout_s, self.config.worker_heartbeat_s
        for channel, address in zip(self.channels, self.addresses, strict=True):
            try:
                grpc.channel_ready_future(channel).result(timeout=10 * heartbeat)
            except grpc.FutureTimeoutError:
                raise WorkerUnavailableError("cannot connect", address=address) from None
        self.health = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        self._wait_serving(deadline=time.monotonic() + timeout)
        # Bytes in, bytes out: the message is serialized once for every rank.
        self.methods = {
            name: [c.unary_unary(f"/{SERVICE}/{name}") for c in self.channels]
            for name in ("GetInfo", "ExecuteModel", "SampleTokens", "Reset", "Shutdown")
        }

    def _wait_serving(self, deadline: float) -> None:
        """Workers listed in the configuration may still be loading their model."""
        while (problem := self._probe()) is not None:
            if time.monotonic() > deadline or "NOT_SERVING" not in problem:
                raise WorkerUnavailableError(problem)
            time.sleep(0.2)

    def _send(self, method: str, payload: bytes, blocking: bool) -> Call:
        callables = self.methods[method]
        metadata = bearer_metadata(self.token.current()) if self.token is not None else None
        if blocking and len(callables) == 1:
            # A plain blocking call skips the future's bookkeeping: ~10% of a step's transport.
            try:
                return DoneCall([callables[0](payload, timeout=self.rpc_timeout_s,
                                              metadata=metadata)])
            except grpc.RpcError as e:
                return DoneCall([WorkerError(e.code(), e.details() or "", 0, self.addresses[0])])
        futures = [m.future(payload, timeout=self.rpc_timeout_s, metadata=metadata)
                   for m in callables]
        return GrpcCall(futures, self.addresses, self)

    def _probe(self) -> str | None:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        for rank, stub in enumerate(self.health):
            try:
                status = stub.Check(request, timeout=3 * self.config.worker_heartbeat_s).status
            except grpc.RpcError as e:
                return f"rank {rank} at {self.addresses[rank]}: health check {e.code().name}"
            if status != health_pb2.HealthCheckResponse.SERVING:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                return f"rank {rank} at {self.addresses[rank]} is {name}"
        return None

    def _close(self) -> None:
        for channel in getattr(self, "channels", ()):
            channel.close()
