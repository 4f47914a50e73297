"""The executor over ZMQ: one DEALER socket per rank, [method, request] out, [status, reply] in.

Replies come back on each rank's socket in the order the calls went out. The waiting caller polls
its sockets in short slices so that a failure latched by the watcher wakes it. The watcher reads
each socket's monitor: a worker that exits drops its connection at once, and a frozen one stops
answering libzmq's heartbeats (handled by libzmq's own threads, so a worker busy with a long step
still answers them) and is disconnected after three heartbeat periods.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from scheduler_svc.executors.errors import WorkerError, WorkerUnavailableError, status_code
from scheduler_svc.executors.remote import Call, Outcome, RemoteExecutor

MAX_MESSAGE_BYTES = 256 << 20
_SLICE_MS = 50  # how long a waiting caller sleeps between looks at the failure latch
_OK = 0


class ZmqCall(Call):
    def __init__(self, executor: ZmqExecutor) -> None:
        self.executor = executor
        self.deadline = time.monotonic() + executor.rpc_timeout_s

    def wait(self) -> list[Outcome]:
        ex = self.executor
        outcomes = []
        # Rank by rank: every reply is needed anyway. The receive timeout (a short slice) lets a
        # failure latched by the watcher wake the caller; a reply wakes it at once.
        for rank, sock in enumerate(ex.sockets):
            while True:
                try:
                    frames = sock.recv_multipart()
                    break
                except zmq.Again:
                    ex.check_alive()
                    if time.monotonic() > self.deadline:
                        raise WorkerUnavailableError(
                            f"no reply within {ex.rpc_timeout_s:g} s", rank,
                            ex.addresses[rank]) from None
            outcomes.append(self._read(rank, frames))
        return outcomes

    def ready(self, timeout_s: float) -> bool:
        # A reply waits on every rank's socket (nothing of this call has been read yet); past
        # the call's deadline wait() raises at once.
        deadline = time.monotonic() + timeout_s
        for sock in self.executor.sockets:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms, zmq.POLLIN):
                return time.monotonic() > self.deadline
        return True

    def _read(self, rank: int, frames: list[bytes]) -> Outcome:
        address = self.executor.addresses[rank]
        if len(frames) != 2 or len(frames[0]) != 1:
            return WorkerError(status_code(13), f"malformed reply of {len(frames)} frames",
                               rank, address)
        if frames[0][0] != _OK:
            return WorkerError(status_code(frames[0][0]), frames[1].decode(errors="replace"),
                               rank, address)
        return frames[1]


class ZmqExecutor(RemoteExecutor):
    transport = "zmq"

    def _connect(self) -> None:
        self.context = zmq.Context(io_threads=1)
        heartbeat_ms = max(100, int(self.config.worker_heartbeat_s * 1000))
        self.sockets: list[zmq.Socket] = []
        self.monitors: list[zmq.Socket] = []
        for address in self.addresses:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * heartbeat_ms)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a lost worker is failed, not waited for
            # Messages are never queued for a worker that is not connected.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RCVTIMEO, _SLICE_MS)
            events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                      | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED)
            monitor = sock.get_monitor_socket(events)
            sock.connect(f"tcp://{address}")
            self.sockets.append(sock)
            self.monitors.append(monitor)
        deadline = time.monotonic() + 10 * self.config.worker_heartbeat_s
        for rank, monitor in enumerate(self.monitors):
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not monitor.poll(remaining_ms):
                    raise WorkerUnavailableError("cannot connect", rank, self.addresses[rank])
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    break

    def _send(self, method: str, payload: bytes, blocking: bool) -> ZmqCall:
        frames = [method.encode(), payload]
        if self.token is not None:
            frames.append(self.token.current().encode())  # worker_svc/server/zmq_server.py
        for rank, sock in enumerate(self.sockets):
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(payload) < 65536)
            except zmq.Again:
                error = WorkerUnavailableError("not connected", rank, self.addresses[rank])
                self._fail(error)
                raise error from None
        return ZmqCall(self)

    def _probe(self) -> str | None:
        for rank, monitor in enumerate(self.monitors):
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    return f"rank {rank} at {self.addresses[rank]} disconnected"
        return None

    def _close(self) -> None:
        for sock in getattr(self, "sockets", ()):
            sock.disable_monitor()
            sock.close(linger=0)
        for monitor in getattr(self, "monitors", ()):
            monitor.close(linger=0)
        if hasattr(self, "context"):
            self.context.term()
