"""The executor over a worker group that Ray places (`executor_backend="ray"`,
`--transport ray`): the ZMQ executor, driving ranks that RayWorkerGroup started.

Two watchers fail it: the ZMQ one (a rank's connection drops, heartbeats stop) and one that
waits on each rank's Ray watch() call (a worker that exits, an actor, raylet or node that
dies). Either way the replicated engine moves the group's requests; releasing the group gives
its placement group back, so that a new one can be placed (ray_replicas.py).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Sequence

from batchwire.common.key_file import WorkerToken

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.executors.ray_group import RayWorkerGroup, connect_ray
from scheduler_svc.executors.worker_group import STARTUP_TIMEOUT_S
from scheduler_svc.executors.zmq_executor import ZmqExecutor


class RayExecutor(ZmqExecutor):
    def __init__(self, config: SchedulerConfig, addresses: Sequence[str] | None = None,
                 avoid_nodes: frozenset[str] = frozenset(),
                 placement_timeout_s: float | None = STARTUP_TIMEOUT_S,
                 stop: threading.Event | None = None) -> None:
        """Places and starts a group, then connects to it. avoid_nodes: Ray node ids holding
        other replicas (this one goes elsewhere when it fits); placement_timeout_s: how long to
        wait for capacity (None: until there is some, or `stop` is set)."""
        if addresses is not None:
            raise ValueError(f"the ray executor places its own worker group; got addresses "
                             f"{list(addresses)} (use the zmq or grpc transport for those)")
        ray = connect_ray(config.ray_address)
        self._token_folder = tempfile.mkdtemp(prefix="batchwire-ray-")
        if config.worker_token_file:
            token = WorkerToken.from_file(config.worker_token_file).current()
        else:
            token = secrets.token_urlsafe(32)
            token_file = os.path.join(self._token_folder, "worker-token")
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            config = dataclasses.replace(config, worker_token_file=token_file)
        self._release_lock = threading.Lock()
        self.ray_group: RayWorkerGroup | None = RayWorkerGroup.start(
            ray, config.worker_config(), token, avoid_nodes, placement_timeout_s, stop)
        self.node_ids = list(self.ray_group.node_ids)  # where its ranks run, in rank order
        try:
            super().__init__(config, self.ray_group.addresses())
        except BaseException:
            self.release()
            raise
        self._ray_watcher = threading.Thread(target=self._watch_ray, name="ray-watch",
                                             daemon=True)
        self._ray_watcher.start()

    @classmethod
    def connect(cls, config: SchedulerConfig, addresses: Sequence[str]) -> Executor:
        """A group that registers itself with a Ray-placing scheduler: driven over ZMQ."""
        return ZmqExecutor(config, addresses)

    def _watch_ray(self) -> None:
        group = self.ray_group
        while group is not None and not self._closed.is_set() and self._failure is None:
            try:
                dead = group.dead_rank(self.config.worker_heartbeat_s)
            except Exception as e:  # Ray itself went away
                dead = (-1, f"Ray cannot be reached ({type(e).__name__}: {e})")
            if dead is not None and not self._closed.is_set():
                rank, what = dead
                address = self.addresses[rank] if rank >= 0 else ""
                self._fail(WorkerUnavailableError(f"rank {rank}: {what}", rank, address))
                return

    def shutdown(self) -> None:
        super().shutdown()
        watcher = getattr(self, "_ray_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        self.release()

    def release(self) -> None:
        """Stops the workers and gives the placement group back (once; any thread)."""
        with self._release_lock:
            group, self.ray_group = self.ray_group, None
        if group is not None:
            group.stop()
            shutil.rmtree(self._token_folder, ignore_errors=True)
