"""A worker group's membership in a scheduler's WorkerRegistry.

Registration runs on a thread of its own: the scheduler may not be up yet (retried with backoff)
and may restart later (Register is repeated every few seconds; for a group still attached that
changes nothing). Deregister, on the way out, blocks until the scheduler has finished or moved
the group's requests.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc
from batchwire.v1 import registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # how often an attached group repeats Register
DRAIN_TIMEOUT_S = 600.0  # the longest Deregister may take


def advertised_host(advertise_host: str | None, bind_host: str) -> str:
    if advertise_host:
        return advertise_host
    if bind_host not in ("0.0.0.0", "", "::", "[::]"):
        return bind_host
    return socket.gethostbyname(socket.gethostname())


class Registration:
    def __init__(
        self,
        scheduler_address: str,
        advertise_host: str | None,
        bind_host: str,
        ranks: list[dict],
        tensor_parallel_size: int,
    ) -> None:
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
        self.channel = grpc.insecure_channel(scheduler_address)
        self.stub = registry_pb2_grpc.WorkerRegistryStub(self.channel)
        self.scheduler_address = scheduler_address
        self.replica_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)

    def register(self) -> None:
        """Starts registering in the background; returns at once."""
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                reply = self.stub.Register(self.request, timeout=120)
                if reply.replica_id != self.replica_id:
                    logger.info(
                        "registered with %s as %s", self.scheduler_address, reply.replica_id
                    )
                self.replica_id = reply.replica_id
                backoff = REFRESH_S
            except grpc.RpcError as e:
                logger.warning("registering with %s: %s %s", self.scheduler_address,
                               e.code().name, e.details())  # fmt: skip
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
                registry_pb2.DeregisterRequest(replica_id=self.replica_id), timeout=DRAIN_TIMEOUT_S
            )
            logger.info("left %s: %d request(s) moved, %d lost", self.scheduler_address,
                        reply.num_moved, reply.num_lost)  # fmt: skip
        except grpc.RpcError as e:
            logger.warning("deregistering from %s: %s %s", self.scheduler_address, e.code().name,
                           e.details())  # fmt: skip
        finally:
            self.channel.close()
