"""The Worker service over ZMQ: the per-step path with the least overhead.

A request is two frames, [method name, serialized protobuf], or three with the worker token
last where the worker has one (`--worker-token-file`); a reply is two frames, [status code as
one byte, serialized protobuf or, on error, the UTF-8 message]. Nothing is pickled.

NOTE: the token rides in a frame of every request, checked with hmac.compare_digest like the
gRPC metadata, rather than in ZMQ's own PLAIN or CURVE handshake. A refusal is then an ordinary
reply, UNAUTHENTICATED, that the executor reports as gRPC does, where a failed ZAP handshake only
looks like a worker that cannot be reached; PLAIN would send the same secret in clear anyway, and
CURVE (which would also encrypt) needs key pairs that nothing here issues or rotates and costs the
hot path its crypto. A link that must be encrypted runs gRPC with mutual TLS, and its workers
open no ZMQ port (--no-zmq, as components/tls starts them).

One thread owns the ROUTER socket; it hands each call to the model thread, the one that loaded
the model and runs every gRPC call too, and waits for it. NOTE: the hand-off costs tens of
microseconds, running torch on a second thread far more: with torch's parallel work split over
two threads' OpenMP teams, a W64 decode step on 2 cores took ~40% longer. Liveness while a long
step runs is answered by libzmq's heartbeats, which need no Python.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor

import grpc
import zmq

from worker_svc.server.servicer import WorkerCallError, WorkerServicer

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_POLL_MS = 100  # how often the loop looks at the stop flag
# A Shutdown call's reply is queued just before the loop sees the stop flag; closing with no
# linger would drop it and leave the caller waiting for an answer that never comes.
_REPLY_LINGER_MS = 1000


def status_frame(code: grpc.StatusCode) -> bytes:
    return bytes((code.value[0],))


OK = status_frame(grpc.StatusCode.OK)


class ZmqWorkerServer:
    def __init__(self, servicer: WorkerServicer, host: str, port: int,
                 model_thread: Executor) -> None:
        self.servicer = servicer
        self.model_thread = model_thread
        self.context = zmq.Context(io_threads=1)
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        bind_host = "*" if host in ("0.0.0.0", "", "[::]") else host
        if port == 0:
            self.port = self.socket.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self.socket.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zmq-worker", daemon=True)

    def start(self) -> int:
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Returns once the call in progress (if any) has been answered and the socket closed."""
        self._stop.set()
        self._thread.join()
        self.context.term()

    def _serve(self) -> None:
        sock = self.socket
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue  # a look at the stop flag
                sock.send_multipart([frames[0], *self._answer(frames[1:])])
        finally:
            sock.close(linger=_REPLY_LINGER_MS)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        expected = 2 if self.servicer.token is None else 3  # a token frame only where one is due
        if len(frames) != expected:
            if len(frames) == 2:
                return _error(grpc.StatusCode.UNAUTHENTICATED, "missing worker token: this "
                              "worker answers only a scheduler started with the same "
                              "--worker-token-file (a third frame)")
            shape = "[method, request]" if expected == 2 else "[method, request, worker token]"
            hint = " (this worker takes no token)" if expected == 2 and len(frames) == 3 else ""
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"expected {expected} frames {shape}, got {len(frames)}{hint}")
        method = frames[0].decode("utf-8", errors="replace")
        try:
            self.servicer.authorize(frames[2] if expected == 3 else None)
            return [OK, self.model_thread.submit(self.servicer.call, method, frames[1]).result()]
        except WorkerCallError as e:
            return _error(e.code, e.message)
        except Exception as e:  # the loop must outlive any one call
            logger.exception("ZMQ %s failed", method)
            return _error(grpc.StatusCode.INTERNAL, f"{method}: {e}")


def _error(code: grpc.StatusCode, message: str) -> list[bytes]:
    return [status_frame(code), message.encode()]
