"""The scheduler service from start to exit: bind, load, warm up, serve, drain, stop.

The port is bound first and health answers NOT_SERVING while the model loads; SERVING comes only
after the workers are ready and one warm-up request has run end to end. SIGTERM (or SIGINT)
drains: NOT_SERVING, new requests refused with UNAVAILABLE, requests in flight run to the end,
then the server stops. A second signal stops now: the requests still running end with an error
(gRPC UNAVAILABLE; on HTTP streams an error event and [DONE]), then the process exits. While no
worker replica is live (the last one died, froze or is leaving) health says NOT_SERVING too, and
SERVING again once one is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import threading
from concurrent.futures import Future
from typing import Any

import grpc
from batchwire.common.ports import PortRequest, check_free
from batchwire.v1 import generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from scheduler_svc.core.generation_config import GenerationConfig, load_generation_config
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.replicas import ReplicatedEngine
from scheduler_svc.service.generation_servicer import SERVICE_NAME, GenerationServicer
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.metrics import SchedulerMetrics, serve_metrics
from scheduler_svc.service.model_loading import describe, load_model, version, warm_up
from scheduler_svc.service.registry import SERVICE_NAME as REGISTRY_SERVICE_NAME
from scheduler_svc.service.registry import WorkerRegistryServicer, add_registry_to_server
from scheduler_svc.service.request_parsing import ParseInHandler
from scheduler_svc.service.security import add_port, interceptors, start_health_server
from scheduler_svc.service.server_config import ServerConfig, ports_to_open, with_free_side_ports
from scheduler_svc.service.status_codes import ServerStoppingError

logger = logging.getLogger(__name__)

REPLICA_WATCH_S = 0.25  # how often health looks at the replicas
# After a second signal: the cut streams' errors go out within this, else the process exits.
STOP_NOW_S = 5.0


def _in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Runs fn on a daemon thread: a model still loading must not keep the process alive."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="load-model", daemon=True).start()
    return asyncio.wrap_future(future)


def _write_ready_file(path: str, info: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)  # a reader sees the whole file or none


class SchedulerServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = SchedulerMetrics()
        self.servicer = GenerationServicer(version(), config.max_message_bytes)
        self.health = HealthServicer()
        # Workers started on their own join here; answered UNAVAILABLE until the engine loads.
        self.registry = WorkerRegistryServicer(None, config.scheduler)
        self.server = grpc.aio.server(
            options=config.grpc_options(),
            interceptors=[*interceptors(config.api_key_file), ParseInHandler()])
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        add_registry_to_server(self.registry, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, REGISTRY_SERVICE_NAME,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.engine: AsyncEngine | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self.http: Any = None  # the HTTP front (service/openai/front.py), unless --no-http
        self._health_server: Any = None
        self._metrics_server: Any = None
        self._stop = asyncio.Event()
        self._signals = 0
        self._last_signal: int = signal.SIGTERM
        self._watcher: Any = None  # the pod watch, with discover_workers
        self._generation = GenerationConfig({}, "not loaded yet")

    async def run(self) -> int:
        """Serves until SIGTERM or SIGINT, then drains; returns the exit status."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._bind()
        self._install_signal_handlers()
        loading = asyncio.ensure_future(_in_thread(self._load))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait((loading, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not loading.done():
            logger.info("stopped while the model was loading")
            await self._stop_servers()
            return 0
        if loading.exception() is not None:
            # Stop the server here: left to the closing event loop it would fail noisily.
            logger.error("cannot start serving: %s", loading.exception(),
                         exc_info=loading.exception())
            await self._stop_servers()
            return 1
        core, tokenizer = loading.result()
        self.engine = AsyncEngine(core)
        self.engine.on_dead = self._on_engine_dead
        self.engine.start()
        self.registry.attach_engine(core)
        if not await self._first_replica(core):
            await self._drain()
            return 0
        model = describe(core, tokenizer, self.engine, self._generation)
        await warm_up(self.engine, tokenizer, model.task, model.vocab_size)
        self.metrics.count_from(self.engine.stats)
        self.engine.observer = self.metrics
        self.metrics.model_name = model.model_name
        self.metrics.batch_invariant.set_function(lambda: float(model.batch_invariant()))
        self.servicer.attach(model)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._print_usage(model)
        watch = asyncio.ensure_future(self._watch_replicas(core))
        await self._stop.wait()
        watch.cancel()
        await self._drain()
        return 1 if self._signals > 1 else 0  # stopped now: requests were cut off

    async def _watch_replicas(self, core: ReplicatedEngine) -> None:
        """Health follows whether a replica can take requests: a load balancer or Kubernetes
        readiness probe then sends them elsewhere. Read from this thread, as workers() does."""
        serving = True
        while True:
            await asyncio.sleep(REPLICA_WATCH_S)
            live = any(not r.failed and not r.draining for r in list(core.replicas))
            if live != serving and self.engine is not None and self.engine.dead is None:
                serving = live
                logger.log(logging.INFO if live else logging.WARNING, "%s",
                           "a worker replica is live: SERVING" if live else
                           "no worker replica is live: NOT_SERVING")
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if live
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _stop_servers(self) -> None:
        await self.server.stop(0)
        if self.http is not None:
            await self.http.stop()

    async def _first_replica(self, core: ReplicatedEngine) -> bool:
        """Waits until a worker group serves (at once unless none was started or configured);
        False when told to stop first."""
        if not core.replicas:
            logger.info("no worker group yet: waiting for one to register "
                        "(batchwire worker --scheduler-address HOST:%d)", self.port)
        while not core.replicas:
            if self._stop.is_set():
                return False
            await asyncio.sleep(0.1)
        return True

    def _load(self) -> tuple[ReplicatedEngine, Any]:
        cfg = self.config
        # Read first: a bad generation config stops the server before the model loads.
        self._generation = load_generation_config(cfg.scheduler.model,
                                                  cfg.scheduler.generation_config)
        if cfg.discover_workers:
            from scheduler_svc.service.discovery import load_discovered

            core, tokenizer, self._watcher = load_discovered(
                cfg.scheduler, cfg.discover_workers, cfg.discovery_namespace,
                cfg.worker_drain_timeout_s)
            return core, tokenizer
        if cfg.scheduler.executor_backend == "ray":  # Ray places the groups, and replaces them
            from scheduler_svc.executors.ray_replicas import RayReplicas

            self._watcher = RayReplicas(cfg.scheduler, cfg.replicas)
            core, tokenizer = load_model(cfg.scheduler, cfg.progress,
                                         executors=list(self._watcher.executors))
            self._watcher.attach_to(core)
            return core, tokenizer
        return load_model(cfg.scheduler, cfg.progress, cfg.replicas)

    async def _bind(self) -> None:
        busy: list[PortRequest] = []
        if self.config.side_ports_fallback:
            self.config, busy = with_free_side_ports(self.config)
        cfg = self.config
        check_free(ports_to_open(cfg))  # before any is bound: nothing to undo when one is taken
        address = f"{cfg.host}:{cfg.port}"
        self.port = add_port(self.server, address, cfg.tls)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        await self.server.start()
        if cfg.health_port is not None:
            self._health_server, self.health_port = await start_health_server(
                self.health, cfg.host, cfg.health_port)
        if cfg.metrics_port is not None:
            self._metrics_server, self.metrics_port = serve_metrics(
                self.metrics.registry, cfg.metrics_host, cfg.metrics_port)
        if cfg.http_port is not None:
            await self._start_http()
        for r in busy:
            taken = self.http_port if r.what == "HTTP" else self.metrics_port
            print(f"batchwire: the {r.what} port {r.port} on {r.host} is in use: serving "
                  f"{r.what} on port {taken} instead", file=sys.stderr, flush=True)
        logger.info("listening on %s:%d (HTTP: %s, metrics: %s); loading the model", cfg.host,
                    self.port, _port_or_off(self.http_port), _port_or_off(self.metrics_port))
        if cfg.ready_file:
            _write_ready_file(cfg.ready_file, {"pid": os.getpid(), "port": self.port,
                                               "metrics_port": self.metrics_port,
                                               "health_port": self.health_port,
                                               "http_port": self.http_port})

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    async def _start_http(self) -> None:
        from scheduler_svc.service.openai.context import FrontContext  # FastAPI: only when used
        from scheduler_svc.service.openai.front import HttpFront
        from scheduler_svc.service.security import ApiKeys

        cfg = self.config
        keys = ApiKeys.from_file(cfg.api_key_file) if cfg.api_key_file else None
        context = FrontContext(self.servicer, self.health, self.metrics.registry, version(),
                               cfg.served_model_names, keys, cfg.max_request_bytes)
        self.http = HttpFront(context, cfg.host, cfg.http_port or 0, cfg.tls)
        await self.http.start()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals > 1:
            self._stop_now(name)
            return
        logger.info("%s: draining (%s again to stop now)", name, _again(sig))
        self._last_signal = sig
        self._stop.set()

    def _stop_now(self, name: str) -> None:
        """Ends the requests in flight with an error their clients read, lets the drain finish
        (now at once), and exits for sure after STOP_NOW_S."""
        if self._signals > 2:
            os._exit(1)
        active = self.engine.num_active if self.engine is not None else 0
        logger.warning("second %s: stopping now, ending %s", name, _requests(active))
        if self.engine is not None:
            self.engine.fail_all(ServerStoppingError(
                "the server is stopping: the request was cut off before it finished"))
        deadline = threading.Timer(STOP_NOW_S, os._exit, (1,))  # should closing the servers hang
        deadline.daemon = True
        deadline.start()

    async def _drain(self) -> None:
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        engine = self.engine
        if engine is not None:
            engine.stop_admitting()
            if engine.num_active:
                logger.info("waiting up to %.0f s for %s in flight to finish (%s again to "
                            "stop now)", self.config.drain_timeout_s,
                            _requests(engine.num_active), _again(self._last_signal))
            try:
                await asyncio.wait_for(engine.wait_until_idle(), self.config.drain_timeout_s)
            except TimeoutError:
                logger.warning("%s still running after %.0f s: stopping anyway",
                               _requests(engine.num_active), self.config.drain_timeout_s)
        # The last messages of finished streams (and of streams cut by a second signal) go out.
        await self.server.stop(grace=5.0)
        if self.http is not None:
            await self.http.stop()
        if self._watcher is not None:
            self._watcher.stop()
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        logger.info("stopped")

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _on_engine_dead(self, error: BaseException) -> None:
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    def _print_usage(self, model: LoadedModel) -> None:
        host = "localhost" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host
        address = f"{host}:{self.port}"
        request = json.dumps({"text": "What is the capital of France?"})
        metrics = (f", metrics on http://{host}:{self.metrics_port}/metrics"
                   if self.metrics_port is not None else "")
        http = (f"\n  OpenAI:  http://{host}:{self.http_port}/v1 (e.g. `curl "
                f"http://{host}:{self.http_port}/v1/models`)" if self.http_port else "")
        cli = _cli_command()
        print(f"batchwire {version()} is serving {model.model_name} on {address}{metrics}\n"
              f"  CLI:     {cli} generate --address {address} 'What is the capital of France?'\n"
              f"           {cli} chat --address {address}\n"
              f"  grpcurl: grpcurl -plaintext -d '{request}' {address} "
              f"{SERVICE_NAME}/Generate\n"
              f"  any language: the service is defined in protos/batchwire/v1/generate.proto"
              f"{http}", flush=True)


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def _again(sig: int) -> str:
    return "press Ctrl-C" if sig == signal.SIGINT else f"send {signal.Signals(sig).name}"


def _port_or_off(port: int | None) -> str:
    return f"port {port}" if port is not None else "off"


def _cli_command() -> str:
    """How this machine's user runs the CLI: on PATH, in this virtualenv, or as a module."""
    if shutil.which("batchwire"):
        return "batchwire"
    beside = os.path.join(os.path.dirname(sys.executable), "batchwire")
    if os.path.exists(beside):
        return os.path.relpath(beside) if not os.path.relpath(beside).startswith("..") else beside
    return f"{sys.executable} -m scheduler_svc.cli"


def serve(config: ServerConfig) -> int:
    async def main() -> int:
        return await SchedulerServer(config).run()  # grpc.aio objects belong to this loop

    try:
        return asyncio.run(main())
    finally:
        sys.stdout.flush()


__all__ = ["SchedulerServer", "ServerConfig", "serve"]
