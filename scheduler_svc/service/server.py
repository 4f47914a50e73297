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
import dataclasses
import importlib.metadata
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
from batchwire.common.model_files import describe_weights
from batchwire.common.ports import PortRequest, check_free, is_free
from batchwire.v1 import generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from tqdm import tqdm

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.generation_config import GenerationConfig, load_generation_config
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.tokenizer import load_tokenizer
from scheduler_svc.core.tool_calls import choose_format
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.replicas import Replica, ReplicatedEngine
from scheduler_svc.executors.base import Executor
from scheduler_svc.service.generation_servicer import SERVICE_NAME, GenerationServicer
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.lora_adapters import LoRAAdapters
from scheduler_svc.service.metrics import SchedulerMetrics, serve_metrics
from scheduler_svc.service.registry import SERVICE_NAME as REGISTRY_SERVICE_NAME
from scheduler_svc.service.registry import WorkerRegistryServicer, add_registry_to_server
from scheduler_svc.service.request_parsing import ParseInHandler
from scheduler_svc.service.security import ServerTls, add_port, interceptors, start_health_server
from scheduler_svc.service.status_codes import ServerStoppingError
from scheduler_svc.service.wire import longest_token_chars

logger = logging.getLogger(__name__)

REPLICA_WATCH_S = 0.25  # how often health looks at the replicas
# After a second signal: the cut streams' errors go out within this, else the process exits.
STOP_NOW_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"  # loopback: nothing here is reachable from elsewhere unless asked
    port: int = 50051  # 0 = any free port (written to ready_file)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9090  # None = no metrics server; 0 = any free port
    ready_file: str | None = None  # JSON with the bound ports, written once bound
    drain_timeout_s: float = 600.0  # the longest in-flight requests may take after SIGTERM
    max_message_bytes: int = 16 << 20  # each way; a 2k-token prompt is ~10 KB
    # Clients behind NATs and load balancers ping to keep idle connections open; accept pings
    # every 10 s or more (gRPC's server default refuses more than one per 5 minutes).
    min_client_ping_interval_s: float = 10.0
    keepalive_time_s: float = 60.0  # the server pings an idle client this often ...
    keepalive_timeout_s: float = 20.0  # ... and drops it when the answer takes longer
    # Connections are closed after this long (plus grace for streams in flight) so that clients
    # reconnect and spread over the replicas behind a Kubernetes Service.
    max_connection_age_s: float = 600.0
    max_connection_age_grace_s: float = 600.0
    progress: bool = True  # progress bar while the model loads
    # Worker groups started by the scheduler (data parallel); 0 with no configured addresses:
    # serve once the first group registers (`batchwire worker --scheduler-address`).
    replicas: int = 1
    tls: ServerTls | None = None  # the client port speaks TLS (mutual with a client CA)
    api_key_file: str | None = None  # clients must send `authorization: Bearer <key>`
    health_port: int | None = None  # plaintext port serving health checks alone (probes)
    # Kubernetes: drive the pods this label selector picks (scheduler_svc/discovery.py).
    discover_workers: str | None = None
    discovery_namespace: str | None = None  # None: the pod's own namespace
    worker_drain_timeout_s: float = 120.0  # a leaving worker's running requests may finish there
    # The OpenAI-compatible HTTP API (service/openai/): None = none; 0 = any free port.
    http_port: int | None = 8000
    served_model_names: tuple[str, ...] = ()  # what /v1/models lists; () = the model's name
    max_request_bytes: int | None = None  # HTTP bodies; None: sized from the model (body.py)
    # A busy metrics or HTTP port is swapped for a free one (and said so) instead of stopping
    # the server: `make run` on a desktop where something else holds 8000 or 9090.
    side_ports_fallback: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65536), got {self.http_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65536), got {self.metrics_port}")
        for name in ("drain_timeout_s", "min_client_ping_interval_s", "keepalive_time_s",
                     "keepalive_timeout_s", "max_connection_age_s", "max_connection_age_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be at least 0, got {self.replicas}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1 << 10:
            raise ValueError(f"max_request_bytes must be at least 1 KiB, got "
                             f"{self.max_request_bytes}")
        if self.max_message_bytes < 1 << 16:
            raise ValueError(f"max_message_bytes must be at least 64 KiB, got "
                             f"{self.max_message_bytes}")

    def grpc_options(self) -> list[tuple[str, Any]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            # Without this a second server on the same port starts silently and splits traffic.
            ("grpc.so_reuseport", 0),
        ]


def version() -> str:
    try:
        return importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_model(config: SchedulerConfig, progress: bool = True, replicas: int = 1,
               executors: list[Executor] | None = None) -> tuple[ReplicatedEngine, Any]:
    """The tokenizer and an engine whose workers are loaded and hold their KV cache.

    A server always runs a ReplicatedEngine, even over one worker group: when that group fails,
    its requests end with UNAVAILABLE and the engine waits for a group to join, where an
    EngineCore would be gone for good."""
    # disable=None: no bar where stderr is not a terminal (a log file would get \r fragments).
    with tqdm(total=2, disable=None if progress else True,
              bar_format="{desc} ({n}/{total}) [{elapsed}]") as bar:
        bar.set_description_str("Loading the tokenizer")
        tokenizer = load_tokenizer(config.model)
        bar.update()
        bar.set_description_str("Loading the model and allocating the KV cache")
        # Configured addresses name the groups; otherwise each executor starts its own.
        if executors is None and not config.worker_addresses:
            executors = [Executor.get_class(config)(config) for _ in range(replicas)]
        core = ReplicatedEngine(config, executors, tokenizer=tokenizer)
        bar.update()
        bar.set_description_str("Loaded")
    return core, tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerView:
    address: str  # its ranks' addresses, comma-separated; "in-process" for the uni transport
    state: str  # "ready", "draining" or "failed"
    device: str
    tensor_parallel_size: int
    batch_invariant: bool  # started with --batch-invariant


def _worker_view(replica: Replica) -> WorkerView:
    executor, info = replica.core.executor, replica.core.info
    addresses = executor.addresses or ["in-process"]
    state = "failed" if executor.failed else "draining" if replica.draining else "ready"
    return WorkerView(",".join(addresses), state, info.device, info.tensor_parallel_size or 1,
                      info.batch_invariant)


def describe(core: ReplicatedEngine, tokenizer: Any, engine: AsyncEngine,
             generation: GenerationConfig) -> LoadedModel:
    """The model as the first replica serves it; every replica that joins serves the same."""
    first = core.replicas[0].core
    scheduler, info = first.scheduler, first.info

    def workers() -> list[WorkerView]:  # replicas come and go while the engine serves
        return [_worker_view(r) for r in list(core.replicas)]

    loras = LoRAAdapters(info.max_loras, info.max_lora_rank, info.model_name)
    for name, path in core.config.lora_modules:  # --lora-modules: a bad one stops the start
        loras.load(name, path)
    return LoadedModel(
        loras=loras, engine=engine, tokenizer=tokenizer, config=core.config,
        model_name=info.model_name,
        vocab_size=scheduler.vocab_size, max_model_len=scheduler.max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        eos_token_ids=sorted(scheduler.eos_token_ids), dtype=info.dtype,
        transport=first.executor.transport or "uni", workers=workers,
        task=first.scheduler.task, pooling_type=info.pooling_type, hidden_size=info.hidden_size,
        max_prompt_chars=scheduler.max_model_len * longest_token_chars(tokenizer),
        generation_config=generation,
        weights=info.weights or describe_weights(core.config.model, info.dtype),
        tool_format=choose_format(core.config.tool_call_parser,
                                  getattr(tokenizer, "chat_template", None)))


async def warm_up(engine: AsyncEngine, tokenizer: Any, task: str = "generate",
                  vocab_size: int | None = None) -> None:
    """One short request through every stage: scheduler, worker, sampler (or pooler),
    detokenizer."""
    ids = [i for i in tokenizer("Hello").input_ids if vocab_size is None or i < vocab_size]
    ids = ids or [0]
    pooling = PoolingParams() if task == "embed" else None
    stream = await engine.add_request("warm-up", ids, SamplingParams(temperature=0, max_tokens=2),
                                      pooling=pooling)
    async for _ in stream:
        pass


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


def ports_to_open(cfg: ServerConfig) -> list[PortRequest]:
    ports = [PortRequest("gRPC", cfg.host, cfg.port, "--port")]
    if cfg.health_port is not None:
        ports.append(PortRequest("health", cfg.host, cfg.health_port, "--health-port"))
    return ports + side_ports(cfg)


def side_ports(cfg: ServerConfig) -> list[PortRequest]:
    """The ports beside the client port: HTTP and metrics."""
    ports = []
    if cfg.http_port is not None:
        ports.append(PortRequest("HTTP", cfg.host, cfg.http_port, "--http-port",
                                 ", or serve no HTTP with --no-http"))
    if cfg.metrics_port is not None:
        ports.append(PortRequest("metrics", cfg.metrics_host, cfg.metrics_port,
                                 "--metrics-port", ", or serve none with --no-metrics"))
    return ports


def with_free_side_ports(cfg: ServerConfig) -> tuple[ServerConfig, list[PortRequest]]:
    """The config with any busy metrics or HTTP port replaced by 0 (any free port), and the
    requests that were busy."""
    busy = [r for r in side_ports(cfg) if not is_free(r)]
    whats = {r.what for r in busy}
    return dataclasses.replace(
        cfg, http_port=0 if "HTTP" in whats else cfg.http_port,
        metrics_port=0 if "metrics" in whats else cfg.metrics_port), busy


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
