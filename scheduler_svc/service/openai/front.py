"""The HTTP front's life inside the scheduler server: bound with the other ports (before the
model loads, so the ready file can name it), served by uvicorn on the server's own event loop,
stopped after the drain.

uvicorn is driven through Server.startup/shutdown rather than serve(): serve() would install
signal handlers of its own over the scheduler's SIGTERM drain.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

import uvicorn

from scheduler_svc.service.openai.app import build_app
from scheduler_svc.service.openai.context import FrontContext
from scheduler_svc.service.security import ServerTls

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # after the drain, for responses still being written


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpFront:
    def __init__(self, context: FrontContext, host: str, port: int,
                 tls: ServerTls | None = None) -> None:
        self.context = context
        self.socket = bind(host, port)
        self.port: int = self.socket.getsockname()[1]
        # The gRPC port's certificate (and client CA) serve HTTPS too: with --tls-cert no
        # client API is left in plaintext.
        certs: dict[str, Any] = {}
        if tls is not None:
            certs = dict(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
            if tls.client_ca_file is not None:
                certs.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        # log_config=None: the process's logging as configured, uvicorn's loggers propagating.
        config = uvicorn.Config(build_app(context), lifespan="off", access_log=False,
                                log_config=None, **certs,
                                log_level=logging.getLogger().getEffectiveLevel(),
                                timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
                                date_header=False, server_header=False)
        self.server: Any = uvicorn.Server(config)

    async def start(self) -> None:
        config = self.server.config
        config.load()  # what Server.serve() does before startup()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup(sockets=[self.socket])

    async def stop(self) -> None:
        if self.server.started:
            await self.server.shutdown(sockets=[self.socket])
        else:
            self.socket.close()
