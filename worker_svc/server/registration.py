"""A worker group's membership in a scheduler's WorkerRegistry.

Registration runs on a thread of its own: the scheduler may not be up yet (retried with backoff)
and may restart later (Register is repeated every few seconds; for a group still attached that
changes nothing). Deregister, on the way out, blocks until the scheduler has finished or moved
the group's requests.

The link to the scheduler is its client port, so it takes the same security as any client
(`SchedulerLink`): TLS trusting a CA (with a name to check instead of the address dialled),
mutual TLS with a certificate of the worker's own, and an API key sent as `authorization: Bearer
<key>` (WorkerRegistry needs one wherever the scheduler has --api-key-file). The key file is read
again at every attempt, so a rotated key is picked up. A worker with a token presents it too
(metadata `x-batchwire-worker-token`): a scheduler with --worker-token-file takes registrations
only from workers that know it, and dials them back with it. Without TLS both secrets go to
whoever answers at --scheduler-address.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from typing import Any

import grpc
from batchwire.common import tls as tls_links
from batchwire.common.key_file import (
    WORKER_TOKEN_HEADER,
    WorkerToken,
    bearer_metadata,
    parse_keys,
)
from batchwire.v1 import registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # how often an attached group repeats Register
DRAIN_TIMEOUT_S = 600.0  # the longest Deregister may take


# A refusal that retrying with the same settings cannot cure; said louder than a scheduler that
# is still starting.
_MISCONFIGURED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.FAILED_PRECONDITION})


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerLink:
    address: str  # the scheduler's client port, host:port
    tls: tls_links.ClientTls | None = None  # None: plaintext
    api_key_file: str | None = None  # its first key is sent as `authorization: Bearer <key>`

    def __post_init__(self) -> None:
        self.metadata()  # a missing or empty key file fails at start-up, not at each attempt

    @classmethod
    def from_args(cls, args: Any) -> SchedulerLink | None:
        """From `batchwire worker`'s options; None without --scheduler-address. Raises
        ValueError for files that cannot be read or options that do not go together."""
        if not args.scheduler_address:
            if args.scheduler_tls_ca or args.scheduler_tls_cert or args.scheduler_api_key_file:
                raise ValueError("--scheduler-tls-* and --scheduler-api-key-file secure "
                                 "registration: they need --scheduler-address")
            return None
        tls = tls_links.ClientTls.from_options(
            args.scheduler_tls_ca, args.scheduler_tls_cert, args.scheduler_tls_key,
            args.scheduler_tls_server_name, what="--scheduler-tls")
        return cls(args.scheduler_address, tls, args.scheduler_api_key_file)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self.api_key_file is None:
            return None
        try:
            with open(self.api_key_file) as f:
                keys = parse_keys(f.read())
        except OSError as e:
            raise ValueError(f"cannot read the scheduler API key file {self.api_key_file!r}: "
                             f"{e.strerror}") from None
        if not keys:
            raise ValueError(f"no API key in {self.api_key_file!r}: the file holds one key a "
                             "line, and the first is sent")
        return bearer_metadata(keys[0])


def advertised_host(advertise_host: str | None, bind_host: str) -> str:
    if advertise_host:
        return advertise_host
    if bind_host not in ("0.0.0.0", "", "::", "[::]"):
        return bind_host
    return socket.gethostbyname(socket.gethostname())


class Registration:
    def __init__(
        self,
        scheduler: SchedulerLink,
        advertise_host: str | None,
        bind_host: str,
        ranks: list[dict],
        tensor_parallel_size: int,
        token: WorkerToken | None = None,
    ) -> None:
        self.token = token  # this group's worker token, presented with each call
        host = advertised_host(advertise_host, bind_host)
        endpoints = [
            registry_pb2.WorkerEndpoint(
                rank=r["rank"], host=host, grpc_port=r["grpc_port"], zmq_port=r["zmq_port"]
            )
            for r in ranks
        ]
        if len(endpoints) != tensor_parallel_size:
            raise ValueError(
                f"a group of {tensor_parallel_size} ranks registers as a whole, from its "
                f"launcher (python -m worker_svc --tensor-parallel-size {tensor_parallel_size} "
                "without --rank)"
            )
        self.request = registry_pb2.RegisterRequest(
            group_id=f"{host}:{ranks[0]['grpc_port']}", ranks=endpoints
        )
        self.scheduler = scheduler
        self.channel = tls_links.channel(scheduler.address, scheduler.tls)
        self.stub = registry_pb2_grpc.WorkerRegistryStub(self.channel)
        self.scheduler_address = scheduler.address
        self.replica_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)

    def register(self) -> None:
        """Starts registering in the background; returns at once."""
        self._thread.start()

    def register_once(self, timeout_s: float = 120.0) -> str:
        """One Register call; returns the replica id, or raises grpc.RpcError."""
        reply = self.stub.Register(self.request, timeout=timeout_s,
                                   metadata=self._metadata())
        if reply.replica_id != self.replica_id:
            logger.info("registered with %s as %s", self.scheduler_address, reply.replica_id)
        self.replica_id = reply.replica_id
        return reply.replica_id

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = ((WORKER_TOKEN_HEADER, self.token.current()),) if self.token else ()
        try:
            return (*(self.scheduler.metadata() or ()), *token)
        except ValueError as e:  # gone or emptied since start-up: try without, and say why
            logger.error("%s", e)
            return token

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                self.register_once()
                backoff = REFRESH_S
            except grpc.RpcError as e:
                # Retried all the same: the scheduler's keys or its workers' token may be fixed
                # while this worker waits.
                log = logger.error if e.code() in _MISCONFIGURED else logger.warning
                log("registering with %s: %s %s%s", self.scheduler_address, e.code().name,
                    e.details(), _hint(e.code()))  # fmt: skip
                backoff = min(2 * backoff, REFRESH_S)
            self._stop.wait(backoff)

    def deregister(self) -> None:
        """Leaves the scheduler; returns once it has finished or moved this group's requests."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.replica_id is None:
            return
        try:
            reply = self.stub.Deregister(
                registry_pb2.DeregisterRequest(replica_id=self.replica_id),
                timeout=DRAIN_TIMEOUT_S, metadata=self._metadata(),
            )
            logger.info("left %s: %d request(s) moved, %d lost", self.scheduler_address,
                        reply.num_moved, reply.num_lost)  # fmt: skip
        except grpc.RpcError as e:
            logger.warning("deregistering from %s: %s %s", self.scheduler_address, e.code().name,
                           e.details())  # fmt: skip
        finally:
            self.channel.close()


def _hint(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (" (the scheduler's --api-key-file and --worker-token-file: this worker's "
                "--scheduler-api-key-file and --worker-token-file)")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return " (give this worker and the scheduler the same --worker-token-file)"
    return ""
