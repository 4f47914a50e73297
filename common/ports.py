"""Ports a command is about to open, checked before it opens any: a port in use ends the command
with one line naming the port and the flag that moves it, not a traceback from whichever library
tried to bind first (gRPC, ZMQ or the metrics HTTP server)."""

from __future__ import annotations

import dataclasses
import errno
import socket


class PortInUseError(OSError):
    """One line for the user: which port, what it is for, which flag moves it."""


@dataclasses.dataclass(frozen=True, slots=True)
class PortRequest:
    what: str  # "gRPC", "metrics"...: what the port would serve
    host: str
    port: int  # 0 = any free port: never in use
    flag: str  # the command-line flag that moves it
    also: str = ""  # another way out, e.g. a flag that closes the port

    def error(self) -> PortInUseError:
        return PortInUseError(
            errno.EADDRINUSE,
            f"the {self.what} port {self.port} on {self.host} is already in use: stop what holds "
            f"it, or pick another with {self.flag} PORT (0 = any free port){self.also}")


def _bind_host(host: str) -> tuple[int, str]:
    host = host.strip("[]")
    if host in ("", "*"):
        return socket.AF_INET, "0.0.0.0"
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), host


def is_free(request: PortRequest) -> bool:
    """Whether the port can be bound now (port 0 always can)."""
    try:
        check_free([request])
    except PortInUseError:
        return False
    return True


def check_free(requests: list[PortRequest]) -> None:
    """Raises PortInUseError for the first port that cannot be bound now. A listener on the port
    (on any local address) refuses the bind even with SO_REUSEADDR, which is set so that a port
    left in TIME_WAIT by a previous run, which gRPC would reuse, does not count as taken."""
    for r in requests:
        if r.port == 0:
            continue
        family, host = _bind_host(r.host)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, r.port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise r.error() from None
                raise


__all__ = ["PortInUseError", "PortRequest", "check_free", "is_free"]
