"""The WorkerRegistry service: worker groups started on their own join and leave a running
ReplicatedEngine (`python -m worker_svc --scheduler-address HOST:PORT`).

Register dials the group's ranks (blocking work, done off the event loop) and hands the connected
executor to the engine; Deregister drains the replica and answers once it has left. Groups
repeat Register every few seconds: for one still attached that changes nothing, and it brings the
groups back to a scheduler that restarted. The scheduler's server hosts this service from the
moment it binds; until its engine is loaded, Register answers UNAVAILABLE and the group retries.

Registering is a privileged act (it hands the group clients' prompts), so the service sits behind
the client port's API-key interceptor like Generation: with --api-key-file a Register without a
key gets UNAUTHENTICATED. A client key alone is not enough where the scheduler has a worker token:
Register and Deregister must then present it too (metadata `x-batchwire-worker-token`), so that
no API client can pass itself off as a worker, nor detach one. Dialling the group back presents
the same token; a group that refuses it gets PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from batchwire.common.key_file import WORKER_TOKEN_HEADER, WorkerToken, header_value
from batchwire.v1 import registry_pb2, registry_pb2_grpc

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.replicas import ReplicatedEngine
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import WorkerError, WorkerRefusedError

logger = logging.getLogger(__name__)

SERVICE_NAME = "batchwire.v1.WorkerRegistry"


class WorkerRegistryServicer(registry_pb2_grpc.WorkerRegistryServicer):
    def __init__(self, engine: ReplicatedEngine | None, config: SchedulerConfig,
                 attach_timeout_s: float = 60.0) -> None:
        self.config = config
        self.attach_timeout_s = attach_timeout_s
        token_file = config.worker_token_file
        self.token = WorkerToken.from_file(token_file) if token_file else None
        self.engine: ReplicatedEngine | None = None  # None until the server has loaded it
        self.executor_class: type[Executor] | None = None
        self.transport = ""
        if engine is not None:
            self.attach_engine(engine)
        self._replicas: dict[str, str] = {}  # group id -> replica id
        self._lock = asyncio.Lock()  # one registration at a time: no group attached twice

    def attach_engine(self, engine: ReplicatedEngine) -> None:
        self.executor_class = Executor.get_class(self.config)
        self.transport = self.executor_class.transport
        self.engine = engine

    async def _check_token(self, context: grpc.aio.ServicerContext) -> None:
        if self.token is None:
            return
        presented = header_value(context.invocation_metadata(), WORKER_TOKEN_HEADER)
        if not presented:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing worker token: this "
                                "scheduler takes registrations only from workers started with "
                                "its --worker-token-file")
        if not self.token.check(presented or ""):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid worker token")

    async def _engine(self, context: grpc.aio.ServicerContext) -> ReplicatedEngine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still loading")
        if self.transport not in ("grpc", "zmq"):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"workers can register only with a scheduler that reaches them over grpc or "
                f"zmq, and this one runs its worker with {self.config.executor_backend!r}")
        assert self.engine is not None
        return self.engine

    async def Register(self, request: registry_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> registry_pb2.RegisterResponse:
        await self._check_token(context)
        if not request.group_id or not request.ranks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group_id and ranks are required")
        engine = await self._engine(context)
        ranks = sorted(request.ranks, key=lambda r: r.rank)
        port = "grpc_port" if self.transport == "grpc" else "zmq_port"
        addresses = [f"{r.host}:{getattr(r, port)}" for r in ranks]
        async with self._lock:
            known = self._replicas.get(request.group_id)
            if known is not None and self._attached(engine, known):
                return registry_pb2.RegisterResponse(replica_id=known)
            replica_id = request.group_id if known is None else f"{request.group_id}#{id(request)}"
            try:
                replica_id = await asyncio.to_thread(self._attach, engine, addresses,
                                                     replica_id)
            except WorkerRefusedError as e:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the group refused this scheduler's credentials: {e} (give the workers and "
                    "the scheduler the same --worker-token-file)")
            except WorkerError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the group: {e}")
            except ValueError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            self._replicas[request.group_id] = replica_id
        logger.info("worker group %s registered as %s: %s", request.group_id, replica_id, addresses)
        return registry_pb2.RegisterResponse(replica_id=replica_id)

    async def Deregister(self, request: registry_pb2.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> registry_pb2.DeregisterResponse:
        await self._check_token(context)
        future = (await self._engine(context)).detach(request.replica_id)
        try:
            moved, lost = await asyncio.wrap_future(future)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.replica_id!r}")
        for group, replica in list(self._replicas.items()):
            if replica == request.replica_id:
                del self._replicas[group]
        logger.info("replica %s left: %d request(s) moved, %d lost", request.replica_id, moved,
                    lost)
        return registry_pb2.DeregisterResponse(num_moved=moved, num_lost=lost)

    def _attach(self, engine: ReplicatedEngine, addresses: list[str], replica_id: str) -> str:
        assert self.executor_class is not None
        executor = self.executor_class.connect(self.config, addresses)
        try:
            return engine.attach(executor, replica_id).result(self.attach_timeout_s)
        except BaseException:
            executor.shutdown()
            raise

    @staticmethod
    def _attached(engine: ReplicatedEngine, replica_id: str) -> bool:
        return any(r.replica_id == replica_id and not r.draining and not r.failed
                   for r in engine.replicas)


def add_registry_to_server(servicer: WorkerRegistryServicer, server: grpc.aio.Server) -> None:
    registry_pb2_grpc.add_WorkerRegistryServicer_to_server(servicer, server)
