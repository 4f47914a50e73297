"""What `batchwire serve` and `batchwire scheduler` are told: ports, limits, keepalives, security;
and which ports that means opening (checked free before any is bound)."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchwire.common.ports import PortRequest, is_free

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.service.security import ServerTls


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


