"""TLS for batchwire's gRPC links, from PEM files (a Kubernetes Secret mounted as a folder).

Server side: a certificate and key, and optionally a CA whose client certificates are then
required (mutual TLS). The files are read again when they change on disk (cert-manager and
kubelet rotate mounted Secrets in place), so a rotation needs no restart: gRPC asks for the
configuration on every new handshake and keeps it while the files' modification times stay.

Client side: the CA that signed the server, and optionally a certificate and key to present.
A worker is dialled by its pod IP, which no certificate names, so the channel checks the name
`server_name` instead (gRPC's ssl_target_name_override): a worker certificate carries that one
name (e.g. `batchwire-worker`) whatever address its pod gets.

Nothing here imports torch or the model: the scheduler and the worker both use it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import grpc

logger = logging.getLogger(__name__)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"the {what} {path!r} is not PEM (no -----BEGIN line)")
    return data


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTls:
    cert_file: str  # PEM certificate chain this server presents
    key_file: str  # PEM private key of that certificate
    client_ca_file: str | None = None  # set: clients must present a certificate it signed

    @classmethod
    def from_options(cls, cert: str | None, key: str | None, client_ca: str | None = None,
                     what: str = "--tls") -> ServerTls | None:
        """None when no file is given (plaintext); an error when only some are."""
        if not cert and not key:
            if client_ca:
                raise ValueError(f"{what}-ca needs {what}-cert and {what}-key: a server must "
                                 "present a certificate of its own to check its clients'")
            return None
        if not cert or not key:
            raise ValueError(f"{what}-cert and {what}-key go together, got only "
                             f"{'the certificate' if cert else 'the key'}")
        tls = cls(cert, key, client_ca or None)
        tls.credentials()  # unreadable or malformed files fail at start-up, not at first call
        return tls

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def _paths(self) -> tuple[str, ...]:
        ca = (self.client_ca_file,) if self.client_ca_file is not None else ()
        return (self.cert_file, self.key_file, *ca)

    def _configuration(self) -> Any:
        ca = _read(self.client_ca_file, "client CA") if self.client_ca_file else None
        pair = (_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        stamp = [_mtimes(self._paths())]

        def fetch() -> Any:
            now = _mtimes(self._paths())
            if now == stamp[0]:
                return None  # unchanged: gRPC keeps the configuration it has
            try:
                config = self._configuration()
            except ValueError as e:  # half-written during a rotation: keep the old one for now
                logger.warning("keeping the current TLS files: %s", e)
                return None
            stamp[0] = now
            logger.info("TLS files changed on disk: new handshakes use them")
            return config

        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), fetch, require_client_authentication=self.mutual)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTls:
    ca_file: str | None = None  # PEM CA that signed the server; None = the system's roots
    cert_file: str | None = None  # PEM certificate this client presents (mutual TLS)
    key_file: str | None = None
    server_name: str | None = None  # check the server's certificate for this name instead

    @classmethod
    def from_options(cls, ca: str | None, cert: str | None = None, key: str | None = None,
                     server_name: str | None = None, what: str = "--tls") -> ClientTls | None:
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            raise ValueError(f"{what}-cert and {what}-key go together, got only "
                             f"{'the certificate' if cert else 'the key'}")
        tls = cls(ca or None, cert or None, key or None, server_name or None)
        tls.credentials()
        return tls

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA") if self.ca_file else None,
            private_key=_read(self.key_file, "TLS key") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "TLS certificate") if self.cert_file else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _mtimes(paths: tuple[str, ...]) -> tuple[float, ...]:
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_mtime)
        except OSError:
            out.append(-1.0)
    return tuple(out)


def add_port(server: Any, address: str, tls: ServerTls | None) -> int:
    """Binds address with TLS when configured; returns the bound port (0: could not bind)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


async def start_health_server(health: Any, host: str, port: int) -> tuple[Any, int]:
    """grpc.health.v1 alone, in plaintext, on a port of its own: kubelet's native gRPC probes
    cannot speak TLS. It shares `health` (a grpc.aio HealthServicer) with the main server, so
    both answer the same; nothing else is served on this port. Returns (server, bound port)."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind the health port {host}:{port}")
    await server.start()
    return server, bound


def channel(address: str, tls: ClientTls | None, options: list[tuple[str, Any]] | None = None,
            aio: bool = False) -> Any:
    """A channel to address, over TLS when configured."""
    options = list(options or [])
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(address, options=options)
    options += tls.channel_options()
    return module.secure_channel(address, tls.credentials(), options=options)


__all__ = ["ClientTls", "ServerTls", "add_port", "channel", "start_health_server"]
