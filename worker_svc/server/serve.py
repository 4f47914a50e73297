"""One worker process from start to exit: bind, load, serve both transports, drain, stop.

The gRPC server comes up first and answers health checks with NOT_SERVING while the model loads;
SERVING means the model is loaded and its KV cache allocated. SIGTERM (or a Shutdown call) drains:
NOT_SERVING, leave the scheduler if registered, answer the call in progress, close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchwire.common.key_file import WorkerToken
from batchwire.common.ports import PortRequest, check_free
from batchwire.common.tls import ServerTls
from batchwire.common.worker_config import WorkerConfig

from worker_svc.server.grpc_server import GrpcWorkerServer
from worker_svc.server.metrics import WorkerMetrics
from worker_svc.server.registration import Registration, SchedulerLink
from worker_svc.server.servicer import WorkerServicer
from worker_svc.server.zmq_server import ZmqWorkerServer

logger = logging.getLogger(__name__)


class LoadInterrupted(Exception):
    """SIGTERM arrived before the model was loaded; the loading thread cannot be stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"  # internal ports: loopback unless told (the pod IP in Kubernetes)
    grpc_port: int = 50061  # 0 = any free port
    zmq_port: int = 50062  # 0 = any free port
    ready_file: str | None = None  # JSON with the bound ports, written once SERVING
    scheduler: SchedulerLink | None = None  # register with this scheduler once SERVING
    advertise_host: str | None = None  # how the scheduler reaches this worker
    grace_s: float = 10.0  # the longest a call in progress may take to finish on shutdown
    tls: ServerTls | None = None  # the gRPC port speaks TLS (mutual with a client CA)
    health_port: int | None = None  # plaintext port serving health checks alone (probes)
    # ZMQ has no TLS: a worker whose gRPC port requires client certificates opens no ZMQ port,
    # which would let anyone on the network around them.
    zmq: bool = True
    parent_pid: int | None = None  # stop once this process is gone (whoever started us)
    metrics_port: int | None = 9091  # Prometheus /metrics; 0 = any free port, None = off
    # Every Worker call must present this token (the scheduler's --worker-token-file);
    # None = any caller that reaches the ports, unless mutual TLS admits only the scheduler.
    token: WorkerToken | None = None
    # Free the batch when it holds requests and no call came for this long (0 = never); longer
    # than the scheduler takes to declare this worker failed (3 x --worker-heartbeat-s).
    scheduler_lost_s: float = 60.0


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def ports_to_open(options: ServeOptions) -> list[PortRequest]:
    host = options.host
    ports = [PortRequest("worker gRPC", host, options.grpc_port, "--port")]
    if options.zmq:
        ports.append(PortRequest("worker ZMQ", host, options.zmq_port, "--zmq-port",
                                 ", or open none with --no-zmq"))
    if options.health_port is not None:
        ports.append(PortRequest("health", host, options.health_port, "--health-port"))
    if options.metrics_port is not None:
        ports.append(PortRequest("metrics", host, options.metrics_port, "--metrics-port",
                                 ", or serve none with --no-metrics"))
    return ports


async def serve(
    config: WorkerConfig,
    options: ServeOptions,
    worker_factory: Callable[[WorkerConfig], Any] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = WorkerMetrics(config.rank)

    def on_shutdown() -> None:
        loop.call_soon_threadsafe(stop.set)

    check_free(ports_to_open(options))  # all of them before the model loads, none bound yet
    servicer = WorkerServicer(
        on_shutdown=on_shutdown,
        metrics=metrics,
        is_output_rank=config.rank == config.output_rank,
        token=options.token,
    )
    _warn_if_open(options)
    metrics_port = None
    if options.metrics_port is not None:
        metrics_port = metrics.serve(options.host, options.metrics_port)
    if options.parent_pid is not None:
        orphan_watch = asyncio.ensure_future(_stop_when_orphaned(options.parent_pid, stop))
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
    abandoned_watch = None
    if options.scheduler_lost_s > 0:
        abandoned_watch = asyncio.ensure_future(
            _free_batch_when_abandoned(servicer, options.scheduler_lost_s, model_thread))
    grpc_server = GrpcWorkerServer(servicer, model_thread)
    grpc_port = await grpc_server.start(options.host, options.grpc_port, options.tls)
    health_port = None
    if options.health_port is not None:
        health_port = await grpc_server.start_health_port(options.host, options.health_port)
    logger.info("rank %d: gRPC on %s:%d, loading the model", config.rank, options.host, grpc_port)
    zmq_server = None
    registration = None
    try:
        if worker_factory is None:
            from worker_svc.runner.worker import Worker  # loads torch: only in a worker process

            worker_factory = Worker
        load = loop.run_in_executor(model_thread, worker_factory, config)
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait((load, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            raise LoadInterrupted("stopped while the model was loading")
        servicer.worker = load.result()
        zmq_port = 0
        if options.zmq:
            zmq_server = ZmqWorkerServer(servicer, options.host, options.zmq_port, model_thread)
            zmq_port = zmq_server.start()
        await grpc_server.set_serving(True)
        logger.info("rank %d: SERVING, gRPC %d, ZMQ %d", config.rank, grpc_port, zmq_port)
        ports = {
            "grpc_port": grpc_port,
            "zmq_port": zmq_port,
            "pid": os.getpid(),
            "rank": config.rank,
        }
        if health_port is not None:
            ports["health_port"] = health_port
        if metrics_port is not None:
            ports["metrics_port"] = metrics_port
        if options.ready_file:
            write_ready_file(options.ready_file, {"ranks": [ports]})
        if options.scheduler is not None:
            registration = Registration(
                options.scheduler,
                options.advertise_host,
                options.host,
                [ports],
                config.world_size,
                options.token,
            )
            registration.register()
        await stop.wait()
    finally:
        logger.info("rank %d: shutting down", config.rank)
        if abandoned_watch is not None:
            abandoned_watch.cancel()
        if registration is not None:
            # Still serving: the scheduler finishes or moves this group's requests first.
            await loop.run_in_executor(None, registration.deregister)
        await grpc_server.set_serving(False)
        if zmq_server is not None:
            await loop.run_in_executor(None, zmq_server.stop)
        await grpc_server.stop(options.grace_s)
        model_thread.shutdown(wait=servicer.worker is not None)
        if options.parent_pid is not None:
            orphan_watch.cancel()


def _warn_if_open(options: ServeOptions) -> None:
    """Loopback stays as easy as before; a port others can reach says what it lets in."""
    if options.token is not None or options.host in ("127.0.0.1", "localhost", "::1"):
        return
    if options.tls is None or not options.tls.mutual:
        logger.warning("no --worker-token-file and no mutual TLS: anyone who reaches %s can run "
                       "steps, Reset or Shutdown on this worker", options.host)
    elif options.zmq:
        logger.warning("mutual TLS guards the gRPC port only: anyone who reaches ZMQ port on %s "
                       "can drive this worker; give --worker-token-file or --no-zmq",
                       options.host)


async def _free_batch_when_abandoned(servicer: WorkerServicer, after_s: float,
                                     model_thread: ThreadPoolExecutor) -> None:
    """A worker cut off from its scheduler (or whose scheduler died) drops the scheduler's
    requests and parked step instead of holding them until someone calls Reset."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(1.0, after_s / 4))
        if await loop.run_in_executor(model_thread, servicer.free_if_abandoned, after_s):
            # Also after the last requests finished: the scheduler names them finished only
            # in its next step, and forgetting them is harmless (an unknown id finishes as well).
            logger.info("no call from the scheduler for %g s: the batch freed, with its "
                        "requests (finished, or left by a scheduler that lost this worker)",
                        after_s)


async def _stop_when_orphaned(parent_pid: int, stop: asyncio.Event, period_s: float = 1.0) -> None:
    """A parent that dies without stopping us (SIGKILL, a crash) re-parents us: then we stop."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(period_s)
    logger.warning("the process that started this worker (%d) is gone: stopping", parent_pid)
    stop.set()
