"""Shutting an executor down never hangs on a worker that does not answer.

Under load on 2 cores the last reply of a ZMQ worker, queued a moment before it closed its
socket with no linger, could be lost; the executor's watcher had already stopped, so the
Shutdown call waited out worker_rpc_timeout_s (600 s) - `bench all --quick` hung in CI. The
worker now lingers to flush that reply, and the executor waits for it no longer than its grace.
"""

from __future__ import annotations

import threading
import time
import types

import zmq
from batchwire.v1 import worker_pb2

from scheduler_svc.executors import remote
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.executors.zmq_executor import ZmqExecutor

from .conftest import scheduler_config

OK = b"\x00"


class SilentOnShutdown:
    """A ZMQ worker of one rank that answers GetInfo and Reset and never answers Shutdown."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.got: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        info = worker_pb2.WorkerInfo(rank=0, pipeline_parallel_size=1, tensor_parallel_size=1,
                                     output_rank=0)
        replies = {b"GetInfo": info.SerializeToString(),
                   b"Reset": worker_pb2.ResetResponse().SerializeToString()}
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, method, _ = self.socket.recv_multipart()
            self.got.append(method)
            if method in replies:
                self.socket.send_multipart([identity, OK, replies[method]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()
        self.context.term()


def test_shutdown_returns_when_the_worker_never_answers(tiny_llama, monkeypatch) -> None:
    monkeypatch.setattr(remote, "SHUTDOWN_REPLY_S", 0.5)
    worker = SilentOnShutdown()
    try:
        config = scheduler_config(tiny_llama, "zmq", (f"127.0.0.1:{worker.port}",))
        executor = ZmqExecutor(config)
        stopped: list[bool] = []
        # As if the executor had started the group: only then does it send Shutdown.
        executor.group = types.SimpleNamespace(stop=lambda asked: stopped.append(asked))
        t0 = time.monotonic()
        executor.shutdown()
        took = time.monotonic() - t0
        assert b"Shutdown" in worker.got
        assert took < 5, f"shutdown took {took:.1f} s"
        assert stopped == [False], "a group that never answered is stopped with signals"
        assert executor.rpc_timeout_s == 0.5
        try:
            executor.collective_rpc("get_info")
        except WorkerUnavailableError as e:
            assert "shut down" in str(e)
        else:
            raise AssertionError("a call after shutdown must fail")
    finally:
        worker.close()
