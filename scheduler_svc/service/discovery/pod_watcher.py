"""The pod watch: lists and then watches the worker pods through the official `kubernetes` client
(get/list/watch on pods in one namespace, by label selector: all the RBAC it needs) and feeds
every event through a WorkerSet to a Membership."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from scheduler_svc.service.discovery.membership import (
    EngineMembership,
    Membership,
    connector,
    replicated_engine,
)
from scheduler_svc.service.discovery.pods import Change, WorkerSet

logger = logging.getLogger(__name__)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def load_discovered(config: Any, label_selector: str, namespace: str | None,
                    drain_timeout_s: float, api: Any = None) -> tuple[Any, Any, PodWatcher]:
    """For the scheduler service: the tokenizer, then a ReplicatedEngine built on the first
    worker pod that is ready (this waits for it), and the watch that keeps the set up to date."""
    from scheduler_svc.core.tokenizer import load_tokenizer

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
