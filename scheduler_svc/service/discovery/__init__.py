"""Worker discovery on Kubernetes: the scheduler watches its worker pods and keeps one worker
group (replica) per pod that is ready to serve.

Three parts, one module each, so that the middle one is testable with made-up events:
  - pod_watcher.PodWatcher: lists and then watches the pods through the official `kubernetes`
    client;
  - pods.WorkerSet: a pure state machine that turns pod events into joins and leaves;
  - membership.EngineMembership: connects an executor to a joining pod and attaches it to the
    engine; detaches a leaving one (the engine moves or finishes its requests).
"""

from scheduler_svc.service.discovery.membership import EngineMembership
from scheduler_svc.service.discovery.pod_watcher import PodWatcher, load_discovered
from scheduler_svc.service.discovery.pods import (
           TP_ANNOTATION,
           Change,
           WorkerGroup,
           WorkerSet,
           pod_group,
)

__all__ = ["TP_ANNOTATION", "Change", "EngineMembership", "PodWatcher", "WorkerGroup",
           "WorkerSet", "load_discovered", "pod_group"]
