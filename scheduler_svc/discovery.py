"""Worker discovery on Kubernetes: the scheduler watches its worker pods and keeps one worker
group (replica) per pod that is ready to serve.

Three parts, so that the middle one is testable with made-up events:
  - PodWatcher: lists and then watches the pods through the official `kubernetes` client
    (get/list/watch on pods in one namespace, by label selector: all the RBAC it needs);
  - WorkerSet: a pure state machine that turns pod events into joins and leaves;
  - EngineMembership: connects an executor to a joining pod and attaches it to the engine;
    detaches a leaving one (the engine moves or finishes its requests).

A pod is in the set while it is Running, Ready, has an IP and is not being deleted. It leaves at
the first event that breaks any of these: a deletionTimestamp (SIGTERM is coming: drain, running
requests may finish within the drain window), an empty IP, phase Failed (evicted) or a DELETED
event (gone: its requests move at once). A pod recreated under the same name (StatefulSet) has a
new uid and is a new group.

One pod is one group: `python -m worker_svc --tensor-parallel-size N` starts its N ranks in the
pod, rank r on the pod's `grpc` and `zmq` container ports + 2r; N comes from the pod annotation
`batchwire.io/tensor-parallel-size` (1 without it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

TP_ANNOTATION = "batchwire.io/tensor-parallel-size"
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_PORTS = {"grpc": 50061, "zmq": 50062}


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerGroup:
    """The ranks one pod serves."""

    pod: str  # pod name
    uid: str  # the pod's uid: a recreated pod of the same name is another group
    host: str  # pod IP
    grpc_ports: tuple[int, ...]  # [tensor_parallel_size], rank order
    zmq_ports: tuple[int, ...]  # [tensor_parallel_size]

    @property
    def key(self) -> str:
        return f"{self.pod}/{self.uid[:8]}"

    def addresses(self, transport: str) -> list[str]:
        ports = self.grpc_ports if transport == "grpc" else self.zmq_ports
        host = self.host
        if ":" in host:  # an IPv6 address needs brackets before the port
            host = f"[{host}]"
        return [f"{host}:{p}" for p in ports]


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    kind: Literal["join", "leave"]
    group: WorkerGroup
    # For a leave: "drain" (the pod is terminating or not ready; its running requests may
    # finish there) or "gone" (no IP, failed, deleted: move its requests now).
    reason: str = ""


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _ready(pod: dict) -> bool:
    for c in _get(pod, "status", "conditions") or ():
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _container_port(pod: dict, name: str) -> int:
    for container in _get(pod, "spec", "containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == name and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_PORTS[name]


def _valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def pod_group(pod: dict) -> tuple[WorkerGroup | None, str]:
    """The group a pod (API JSON, as a dict) serves now, or None and why it serves nothing."""
    meta = pod.get("metadata") or {}
    name, uid = meta.get("name") or "", meta.get("uid") or ""
    ip = _get(pod, "status", "podIP") or ""
    phase = _get(pod, "status", "phase") or ""
    if phase in ("Failed", "Succeeded"):
        return None, "gone"  # evicted, or exited for good
    if not ip or not _valid_ip(ip):
        return None, "gone"
    if meta.get("deletionTimestamp"):
        return None, "drain"
    if phase != "Running" or not _ready(pod):
        return None, "drain"
    try:
        tp = int((meta.get("annotations") or {}).get(TP_ANNOTATION, 1))
    except ValueError:
        logger.warning("pod %s: annotation %s is not a number; taken as 1", name, TP_ANNOTATION)
        tp = 1
    grpc_port, zmq_port = _container_port(pod, "grpc"), _container_port(pod, "zmq")
    ranks = range(max(tp, 1))
    return WorkerGroup(name, uid, ip, tuple(grpc_port + 2 * r for r in ranks),
                       tuple(zmq_port + 2 * r for r in ranks)), ""


class WorkerSet:
    """The pods that should receive requests, updated one event at a time.

    apply() takes a watch event (ADDED, MODIFIED, DELETED) and resync() a full listing; both
    return the joins and leaves that bring the engine in line. Leaves come before joins.
    """

    def __init__(self) -> None:
        self.groups: dict[str, WorkerGroup] = {}  # pod name -> group

    def apply(self, event: str, pod: dict) -> list[Change]:
        name = _get(pod, "metadata", "name")
        if not name:
            return []
        if event == "DELETED":
            group, reason = None, "gone"
        else:
            group, reason = pod_group(pod)
        return self._set(name, group, reason)

    def resync(self, pods: Iterable[dict]) -> list[Change]:
        """After a (re)list: pods no longer listed are gone."""
        listed: dict[str, tuple[WorkerGroup | None, str]] = {}
        for pod in pods:
            name = _get(pod, "metadata", "name")
            if name:
                listed[name] = pod_group(pod)
        changes: list[Change] = []
        for name in [n for n in self.groups if n not in listed]:
            changes += self._set(name, None, "gone")
        for name, (group, reason) in listed.items():
            changes += self._set(name, group, reason)
        return sorted(changes, key=lambda c: c.kind != "leave")

    def _set(self, name: str, group: WorkerGroup | None, reason: str) -> list[Change]:
        old = self.groups.get(name)
        if old == group:
            return []
        changes = []
        if old is not None:
            del self.groups[name]
            changes.append(Change("leave", old, reason or "gone"))
        if group is not None:
            self.groups[name] = group
            changes.append(Change("join", group))
        return changes


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
        from scheduler_svc.replicas import ReplicatedEngine

        engine = ReplicatedEngine(config, [executor], tokenizer=tokenizer,
                                  drain_timeout_s=drain_timeout_s)
        # Named after its pod like every later one (the engine has not started stepping yet).
        engine.replicas[0].replica_id = replica_id
        return engine

    return make


def connector(config: Any) -> Callable[[WorkerGroup], Any]:
    """connect for EngineMembership: an executor of the configured transport on a pod's ranks."""
    from scheduler_svc.executor import Executor

    cls = Executor.get_class(config)
    transport = getattr(cls, "transport", "")
    if transport not in ("grpc", "zmq"):
        raise ValueError(f"discovered workers need a remote transport (grpc or zmq), not "
                         f"{config.executor_backend!r}")
    return lambda group: cls(config, group.addresses(transport))


def load_discovered(config: Any, label_selector: str, namespace: str | None,
                    drain_timeout_s: float, api: Any = None) -> tuple[Any, Any, PodWatcher]:
    """For the scheduler service: the tokenizer, then a ReplicatedEngine built on the first
    worker pod that is ready (this waits for it), and the watch that keeps the set up to date."""
    from scheduler_svc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    membership = EngineMembership(None, connector(config),
                                  make_engine=replicated_engine(config, tokenizer, drain_timeout_s))
    watcher = PodWatcher(membership, label_selector, namespace, api).start()
    logger.info("waiting for a worker pod to be ready (%s)", label_selector)
    return membership.wait_engine(), tokenizer, watcher


def current_namespace(default: str = "default") -> str:
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or default
    except OSError:
        return default


class PodWatcher:
    """Lists, then watches, the worker pods; feeds every event through a WorkerSet."""

    def __init__(self, membership: Membership, label_selector: str,
                 namespace: str | None = None, api: Any = None,
                 watch_timeout_s: int = 240) -> None:
        self.membership = membership
        self.label_selector = label_selector
        self.namespace = namespace or current_namespace()
        self.workers = WorkerSet()
        self.watch_timeout_s = watch_timeout_s
        self._api = api
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="pod-watcher", daemon=True)

    def start(self) -> PodWatcher:
        if self._api is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise RuntimeError("worker discovery needs the Kubernetes client: "
                                   "pip install 'batchwire[k8s]'") from None

            try:
                config.load_incluster_config()
            except config.ConfigException:
                # Outside a cluster: the operator's kubeconfig, read from $KUBECONFIG now
                # (the client reads it once, at import).
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            self._api = client.CoreV1Api()
        logger.info("watching pods %r in namespace %s", self.label_selector, self.namespace)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        close = getattr(self.membership, "close", None)
        if close is not None:
            close()

    def dispatch(self, changes: list[Change]) -> None:
        for change in changes:
            if change.kind == "leave":
                self.membership.leave(change.group, change.reason)
            else:
                self.membership.join(change.group)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 1.0
        while not self._stop.is_set():
            try:
                listing = self._api.list_namespaced_pod(self.namespace,
                                                        label_selector=self.label_selector)
                self.dispatch(self.workers.resync([to_dict(p) for p in listing.items]))
                self._watch = watch.Watch()
                for event in self._watch.stream(
                        self._api.list_namespaced_pod, self.namespace,
                        label_selector=self.label_selector,
                        resource_version=listing.metadata.resource_version,
                        timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        return
                    if event["type"] == "ERROR":  # e.g. 410 Gone: list again
                        break
                    self.dispatch(self.workers.apply(event["type"], to_dict(event["object"])))
                backoff = 1.0
            except ApiException as e:
                if e.status == 410:  # the resource version expired: list again now
                    continue
                logger.warning("pod watch: %s %s; listing again in %.0f s", e.status, e.reason,
                               backoff)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 30.0)
            except Exception as e:  # the API server restarting, a network blip
                if self._stop.is_set():
                    return
                logger.warning("pod watch failed: %s; listing again in %.0f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 30.0)


def to_dict(obj: Any) -> dict:
    """A pod from the client (V1Pod) or raw JSON, as the API's JSON dict (camelCase keys)."""
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


__all__ = ["Change", "EngineMembership", "PodWatcher", "WorkerGroup", "WorkerSet", "pod_group"]
