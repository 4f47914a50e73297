"""Joins and leaves applied to the engine: connects an executor to a joining pod and attaches it,
detaches a leaving one (the engine moves or finishes its requests)."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from scheduler_svc.service.discovery.pods import WorkerGroup

logger = logging.getLogger(__name__)


class Membership(Protocol):
    def join(self, group: WorkerGroup) -> None: ...
    def leave(self, group: WorkerGroup, reason: str) -> None: ...


class EngineMembership:
    """Attaches pods to a ReplicatedEngine-like object (attach(executor, id) / detach(id, timeout)).

    join() and leave() return at once: connecting to a pod runs on a thread pool, so that a slow
    pod delays no other event. A pod that leaves while it is still being connected is detached
    as soon as it has been attached. Each join gets a replica id of its own: a pod that was not
    ready for a moment comes back while its old replica may still be draining.

    Without an engine, the first pod that connects makes one: make_engine(executor, replica_id)
    (the engine learns the model's shape from its first worker); wait_engine() returns it.
    """

    def __init__(self, engine: Any, connect: Callable[[WorkerGroup], Any],
                 make_engine: Callable[[Any, str], Any] | None = None,
                 attach_timeout_s: float = 120.0, retries: int = 3) -> None:
        if engine is None and make_engine is None:
            raise ValueError("give an engine, or make_engine to build one on the first pod")
        self.engine = engine
        self.connect = connect  # group -> a connected Executor (blocking)
        self.make_engine = make_engine
        self._engine_ready = threading.Event()
        if engine is not None:
            self._engine_ready.set()
        self._creating = threading.Lock()
        self.attach_timeout_s = attach_timeout_s
        self.retries = retries
        self._wanted: dict[str, str] = {}  # group key (pod/uid) -> the replica id it joins as
        self._joins = itertools.count()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="discovery")

    def join(self, group: WorkerGroup) -> None:
        with self._lock:
            replica_id = f"{group.key}#{next(self._joins)}"
            self._wanted[group.key] = replica_id
        self._pool.submit(self._attach, group, replica_id)

    def leave(self, group: WorkerGroup, reason: str) -> None:
        with self._lock:
            replica_id = self._wanted.pop(group.key, None)
        if replica_id is not None:
            self._detach(group, replica_id, reason)

    def _attach(self, group: WorkerGroup, replica_id: str) -> None:
        for attempt in range(self.retries):
            if not self._still_wanted(group, replica_id):
                return
            executor = None
            try:
                executor = self.connect(group)
                self._attach_executor(executor, replica_id)
            except Exception as e:
                if executor is not None:
                    executor.shutdown()
                logger.warning("pod %s (%s): cannot attach (try %d of %d): %s", group.pod,
                               group.host, attempt + 1, self.retries, e)
                time.sleep(min(2.0**attempt, 10.0))
                continue
            logger.info("pod %s (%s) joined as %s", group.pod, group.host, replica_id)
            if not self._still_wanted(group, replica_id):  # it left while connecting
                self._detach(group, replica_id, "gone")
            return

    def _attach_executor(self, executor: Any, replica_id: str) -> None:
        with self._creating:
            if self.engine is None:
                assert self.make_engine is not None
                self.engine = self.make_engine(executor, replica_id)
                self._engine_ready.set()
                return
        self.engine.attach(executor, replica_id).result(self.attach_timeout_s)

    def wait_engine(self, timeout_s: float | None = None) -> Any:
        """The engine, once there is one (the first pod attached)."""
        if not self._engine_ready.wait(timeout_s):
            raise TimeoutError(f"no worker pod became ready in {timeout_s} s")
        return self.engine

    def _detach(self, group: WorkerGroup, replica_id: str, reason: str) -> None:
        if self.engine is None:
            return  # nothing attached yet
        timeout = 0.0 if reason == "gone" else None  # None: the engine's drain window
        future = self.engine.detach(replica_id, timeout)
        future.add_done_callback(lambda f: _log_left(group, reason, f))

    def _still_wanted(self, group: WorkerGroup, replica_id: str) -> bool:
        with self._lock:
            return self._wanted.get(group.key) == replica_id

    def close(self) -> None:
        with self._lock:
            self._wanted.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _log_left(group: WorkerGroup, reason: str, future: concurrent.futures.Future) -> None:
    try:
        moved, lost = future.result()
    except KeyError:
        return  # never attached, or already dropped after a failure
    except Exception as e:
        logger.warning("pod %s: leaving failed: %s", group.pod, e)
        return
    logger.info("pod %s left (%s): %d request(s) moved, %d lost", group.pod, reason, moved, lost)


def replicated_engine(config: Any, tokenizer: Any, drain_timeout_s: float
                      ) -> Callable[[Any, str], Any]:
    """make_engine for EngineMembership: a ReplicatedEngine on the first pod's executor."""

    def make(executor: Any, replica_id: str) -> Any:
        from scheduler_svc.engine.replicas import ReplicatedEngine

        engine = ReplicatedEngine(config, [executor], tokenizer=tokenizer,
                                  drain_timeout_s=drain_timeout_s)
        # Named after its pod like every later one (the engine has not started stepping yet).
        engine.replicas[0].replica_id = replica_id
        return engine

    return make


def connector(config: Any) -> Callable[[WorkerGroup], Any]:
    """connect for EngineMembership: an executor of the configured transport on a pod's ranks."""
    from scheduler_svc.executors.base import Executor

    cls = Executor.get_class(config)
    transport = cls.transport
    if transport not in ("grpc", "zmq"):
        raise ValueError(f"discovered workers need a remote transport (grpc or zmq), not "
                         f"{config.executor_backend!r}")
    return lambda group: cls.connect(config, group.addresses(transport))
