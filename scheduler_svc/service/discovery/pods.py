"""The pods that should receive requests: a pure state machine over pod events (no client, no
engine), so that it is testable with made-up events.

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

import dataclasses
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any, Literal

logger = logging.getLogger(__name__)

TP_ANNOTATION = "batchwire.io/tensor-parallel-size"
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
