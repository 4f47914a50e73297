"""A worker group that Ray places and supervises: a placement group of P x T bundles (PACK),
one actor per rank in its bundle, and in each actor the ordinary `python -m worker_svc` for that
rank, bound to the node's address. Ray only places, starts and watches; the steps go over the
group's own ZMQ sockets (a Ray call costs about 1 ms, a ZMQ round trip about 50 us).

Each worker process dies with its actor: it is started with a parent-death signal (SIGKILL when
the actor's process goes, however it goes) and with --parent-pid (it also stops on its own when
orphaned). `watch()` is a call that lasts as long as the worker: it returns when the worker
exits, and fails when the actor, its raylet or its node dies, so `ray.wait` on it sees either.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from batchwire.common.worker_config import WorkerConfig

from scheduler_svc.executors.worker_group import STARTUP_TIMEOUT_S, RankEndpoint, wait_ready

logger = logging.getLogger(__name__)

RAY_MISSING = "the ray transport needs Ray: pip install 'batchwire[ray]'"
_STOP_GRACE_S = 10.0
_PLACEMENT_SLICE_S = 0.5  # how often a wait for capacity looks whether it was told to stop


class RayMissingError(ImportError):
    """Ray is not installed; the message names the extra that installs it."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayMissingError(RAY_MISSING) from e
    return ray


def connect_ray(address: str | None) -> Any:
    """Ray, connected: to `address`, else $RAY_ADDRESS, else a local Ray started for this
    process. A process already connected stays with its cluster."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None,
                 log_to_driver=False, configure_logging=False)
    return ray


def _die_with_parent() -> None:
    """preexec_fn of the worker: SIGKILL from the kernel when the actor's process is gone."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class RankActor:
    """One rank's Ray actor (made remote by `_actor_class`): starts and watches its worker."""

    def __init__(self) -> None:
        self.process: Any = None
        self.folder: str | None = None  # the worker's token and ready file

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def free_port(self, host: str) -> int:
        """A port free on this node now, for the group's torch.distributed rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

    def start(self, argv: list[str], token: str) -> dict:
        """Starts the worker and returns its ready-file entry once it serves."""
        import subprocess
        import sys
        import tempfile

        self.folder = folder = tempfile.mkdtemp(prefix="batchwire-ray-worker-")
        token_file = os.path.join(folder, "worker-token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        ready = os.path.join(folder, "ready.json")
        cmd = [sys.executable, "-m", "worker_svc", *argv, "--ready-file", ready,
               "--worker-token-file", token_file, "--parent-pid", str(os.getpid())]
        self.process = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        return wait_ready(self.process, ready, cmd)[0]

    def watch(self) -> int | None:
        """Lasts as long as the worker; its exit code."""
        if self.process is None:
            return None
        code = self.process.wait()
        self._remove_folder()
        return code

    def stop(self) -> None:
        import subprocess

        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._remove_folder()

    def _remove_folder(self) -> None:
        import shutil

        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _actor_class(ray: Any) -> Any:
    # Watch runs beside the other calls: a threaded actor.
    return ray.remote(max_concurrency=4)(RankActor)


def group_bundles(config: WorkerConfig) -> list[dict[str, float]]:
    """One bundle per rank: a GPU when the workers run on CUDA, else a CPU."""
    unit = "GPU" if config.device.startswith("cuda") else "CPU"
    return [{unit: 1.0} for _ in range(config.world_size)]


def preferred_node(ray: Any, bundles: list[dict[str, float]], avoid: set[str]) -> str | None:
    """A live node holding no replica of ours (`avoid`) whose resources fit the whole group:
    replicas spread across nodes when they can; None when none fits (the group goes anywhere)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    for node in ray.nodes():
        if not node["Alive"] or node["NodeID"] in avoid:
            continue
        if all(node["Resources"].get(k, 0.0) >= v for k, v in need.items()):
            return node["NodeID"]
    return None


class PlacementCancelled(Exception):
    """Told to stop while waiting for Ray to place a group."""


def _wait_placed(ray: Any, pg: Any, bundles: list, timeout_s: float | None,
                 stop: threading.Event) -> None:
    ready = pg.ready()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ray.wait([ready], timeout=_PLACEMENT_SLICE_S)[0]:
        if stop.is_set():
            raise PlacementCancelled(f"stopped while waiting to place {bundles}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"Ray could not place {bundles} within {timeout_s:g} s")
    ray.get(ready)


@dataclasses.dataclass
class RayWorkerGroup:
    ray: Any
    placement_group: Any
    actors: list[Any]
    endpoints: list[RankEndpoint]
    node_ids: list[str]
    watches: list[Any]  # one watch() call per rank, in rank order
    pids: list[int]  # the worker processes, each on its rank's node

    @classmethod
    def start(cls, ray: Any, config: WorkerConfig, token: str,
              avoid_nodes: frozenset[str] = frozenset(),
              timeout_s: float | None = STARTUP_TIMEOUT_S,
              stop: threading.Event | None = None) -> RayWorkerGroup:
        """Places the group and starts its ranks; waits for capacity up to timeout_s (None:
        until there is some, or until `stop` is set: PlacementCancelled). Everything started is
        released again if it fails."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = group_bundles(config)
        target = preferred_node(ray, bundles, set(avoid_nodes))
        # Soft targets need STRICT_PACK; without one, PACK lets a group span nodes.
        pg = placement_group(bundles, strategy="STRICT_PACK" if target else "PACK",
                             _soft_target_node_id=target)
        actors: list[Any] = []
        try:
            _wait_placed(ray, pg, bundles, timeout_s, stop or threading.Event())
            remote = _actor_class(ray)
            bundle_cpus = bundles[0].get("CPU", 0.0)
            for rank in range(len(bundles)):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)
                actors.append(remote.options(
                    scheduling_strategy=strategy, num_cpus=bundle_cpus,
                    num_gpus=bundles[rank].get("GPU", 0.0)).remote())
            # The address Ray knows each node by (a process's own guess can name another
            # interface, or another node's address when nodes share a host).
            addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            nodes = [(node, addresses[node])
                     for node in ray.get([a.node_id.remote() for a in actors])]
            rendezvous = f"tcp://{nodes[0][1]}:{ray.get(actors[0].free_port.remote(nodes[0][1]))}"
            starts = []
            for rank, (actor, (_, host)) in enumerate(zip(actors, nodes, strict=True)):
                argv = [*config.to_argv(), "--rank", str(rank), "--host", host,
                        "--port", "0", "--zmq-port", "0", "--metrics-port", "0",
                        "--distributed-init-method", rendezvous]
                starts.append(actor.start.remote(argv, token))
            ranks = ray.get(starts)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pg)
            raise
        endpoints = [RankEndpoint(r["rank"], host, r["grpc_port"], r["zmq_port"],
                                  r.get("metrics_port")) for r, (_, host) in zip(ranks, nodes,
                                                                                 strict=True)]
        watches = [a.watch.remote() for a in actors]
        logger.info("Ray placed a worker group on nodes %s: %s", [n for n, _ in nodes], endpoints)
        return cls(ray, pg, actors, endpoints, [n for n, _ in nodes], watches,
                   [r["pid"] for r in ranks])

    def addresses(self) -> list[str]:
        return [e.address("zmq") for e in self.endpoints]

    def dead_rank(self, timeout_s: float) -> tuple[int, str] | None:
        """Waits up to timeout_s for a rank's worker or actor to end: (rank, what happened)."""
        done, _ = self.ray.wait(self.watches, num_returns=1, timeout=timeout_s)
        if not done:
            return None
        rank = self.watches.index(done[0])
        try:
            code = self.ray.get(done[0])
            return rank, f"its worker exited with {code}"
        except Exception as e:  # ActorDiedError, a lost node or raylet: the actor is gone
            return rank, f"its Ray actor died ({type(e).__name__})"

    def stop(self) -> None:
        """Stops the workers (SIGTERM, a grace period), then the actors and the placement
        group, so that Ray can place a new group on what this one held."""
        from ray.util.placement_group import remove_placement_group

        stops = [a.stop.remote() for a in self.actors]
        self.ray.wait(stops, num_returns=len(stops), timeout=_STOP_GRACE_S + 5)
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone with its node
                logger.debug("killing a Ray actor", exc_info=True)
        try:
            remove_placement_group(self.placement_group)
        except Exception:
            logger.debug("removing a placement group", exc_info=True)
