"""Keeps N Ray-placed replicas in a replicated engine (`--transport ray --replicas N`).

Each replica is a RayExecutor with a placement group of its own, put on a node that holds no
other replica when one fits (replicas spread, a replica's ranks pack). When a replica fails
(its node, raylet, actor or worker died) the engine moves its requests as for any replica; this
supervisor gives the dead group's placement group back and asks Ray for a new one, which is
placed when capacity allows (a node joins, or comes back), then attaches it to the engine.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.ray_executor import RayExecutor
from scheduler_svc.executors.ray_group import PlacementCancelled

logger = logging.getLogger(__name__)


class RayReplicas:
    def __init__(self, config: SchedulerConfig, count: int) -> None:
        """Places and starts `count` replicas (waiting for their capacity); attach_to() then
        hands them to an engine and keeps them at that number."""
        if count < 1:
            raise ValueError(f"the ray transport needs at least 1 replica, got {count}")
        self.config = config
        self.executors: list[RayExecutor | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            for _ in range(count):
                self.executors.append(RayExecutor(config, avoid_nodes=self._busy_nodes()))
        except BaseException:
            self.stop()
            for executor in self.executors:
                if executor is not None:
                    executor.shutdown()
            raise

    def _busy_nodes(self) -> frozenset[str]:
        return frozenset(node for e in self.executors if e is not None and not e.failed
                         for node in e.node_ids)

    def attach_to(self, engine: Any) -> None:
        """Replaces failed replicas of `engine` (a ReplicatedEngine) from now on."""
        self._engine = engine
        self._thread = threading.Thread(target=self._run, name="ray-replicas", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.config.worker_heartbeat_s
        while not self._stop.wait(period):
            for slot, executor in enumerate(self.executors):
                if executor is not None and not executor.failed:
                    continue
                if executor is not None:
                    # Its requests move in the engine thread, which also closes its sockets;
                    # the placement group must go now, or the new one may find no room.
                    executor.release()
                    self.executors[slot] = None
                    logger.warning("a Ray replica failed: asking Ray for a new placement")
                try:
                    replacement = RayExecutor(self.config, avoid_nodes=self._busy_nodes(),
                                              placement_timeout_s=None, stop=self._stop)
                except PlacementCancelled:
                    return
                except Exception:  # e.g. the new group failed to start: try again
                    logger.exception("starting a replacement Ray replica")
                    continue
                if self._stop.is_set():
                    replacement.shutdown()
                    return
                self.executors[slot] = replacement
                self._engine.attach(replacement)
                logger.info("a Ray replica is back on node(s) %s", replacement.node_ids)

    def stop(self) -> None:
        """Stops replacing replicas (the engine shuts down the ones it holds)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

