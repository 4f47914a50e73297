"""Worker discovery: pod events in, the right worker set (and engine membership) out."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import Future

import pytest

from scheduler_svc.service.discovery import (
    TP_ANNOTATION,
    EngineMembership,
    PodWatcher,
    WorkerSet,
    pod_group,
)


def make_pod(name: str, ip: str = "10.0.0.1", phase: str = "Running", ready: bool = True,
             deleting: bool = False, uid: str | None = None, tp: int | None = None,
             grpc_port: int = 50061, zmq_port: int = 50062) -> dict:
    """A worker pod as the API serves it (JSON, camelCase)."""
    meta: dict = {"name": name, "uid": uid or f"uid-{name}", "namespace": "serving",
                  "labels": {"app.kubernetes.io/component": "worker"}}
    if tp is not None:
        meta["annotations"] = {TP_ANNOTATION: str(tp)}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict = {"phase": phase,
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    ports = [{"name": "grpc", "containerPort": grpc_port},
             {"name": "zmq", "containerPort": zmq_port},
             {"name": "metrics", "containerPort": 9091}]
    return {"metadata": meta, "spec": {"containers": [{"name": "worker", "ports": ports}]},
            "status": status}


class RecordingMembership:
    """Keeps the joined groups; refuses a join twice or a leave of a group never joined."""

    def __init__(self) -> None:
        self.joined: dict[str, object] = {}
        self.log: list[tuple[str, str, str]] = []

    def join(self, group) -> None:
        assert group.pod not in self.joined, f"{group.pod} joined twice"
        self.joined[group.pod] = group
        self.log.append(("join", group.pod, ""))

    def leave(self, group, reason: str) -> None:
        assert self.joined.pop(group.pod) == group
        self.log.append(("leave", group.pod, reason))


def feed(workers: WorkerSet, membership: RecordingMembership, event: str, pod: dict) -> None:
    for change in workers.apply(event, pod):
        if change.kind == "join":
            membership.join(change.group)
        else:
            membership.leave(change.group, change.reason)


def test_a_pod_joins_when_ready_and_leaves_at_once_when_terminating():
    workers, members = WorkerSet(), RecordingMembership()
    steps = [
        ("ADDED", make_pod("w-0", ip="", phase="Pending", ready=False), set()),
        ("MODIFIED", make_pod("w-0", phase="Running", ready=False), set()),  # loading the model
        ("MODIFIED", make_pod("w-0"), {"w-0"}),
        ("MODIFIED", make_pod("w-0"), {"w-0"}),  # a status update that changes nothing
        ("ADDED", make_pod("w-1", ip="10.0.0.2"), {"w-0", "w-1"}),
        ("MODIFIED", make_pod("w-0", deleting=True), {"w-1"}),  # SIGTERM is coming: drain
        ("MODIFIED", make_pod("w-0", deleting=True, ready=False), {"w-1"}),
        ("DELETED", make_pod("w-0", deleting=True, ready=False), {"w-1"}),
        ("MODIFIED", make_pod("w-1", ip="", phase="Failed", ready=False), set()),  # evicted
        ("ADDED", make_pod("w-0", ip="10.0.0.9", uid="new", ready=False), set()),  # recreated
        ("MODIFIED", make_pod("w-0", ip="10.0.0.9", uid="new"), {"w-0"}),
    ]
    for event, pod, expected in steps:
        feed(workers, members, event, pod)
        assert set(workers.groups) == expected == set(members.joined), (event, pod)
    assert members.log == [
        ("join", "w-0", ""), ("join", "w-1", ""), ("leave", "w-0", "drain"),
        ("leave", "w-1", "gone"), ("join", "w-0", ""),
    ]
    assert members.joined["w-0"].host == "10.0.0.9" and members.joined["w-0"].uid == "new"


@pytest.mark.parametrize("pod, reason", [
    (make_pod("w", ip=""), "gone"),  # the IP became empty
    (make_pod("w", phase="Failed"), "gone"),  # evicted, IP still shown
    (make_pod("w", phase="Succeeded"), "gone"),
    (make_pod("w", ip="not-an-ip"), "gone"),
    (make_pod("w", deleting=True), "drain"),
    (make_pod("w", ready=False), "drain"),  # not ready: probes failing or draining
    (make_pod("w", phase="Pending"), "drain"),
])
def test_pods_that_serve_nothing(pod, reason):
    assert pod_group(pod) == (None, reason)
    workers = WorkerSet()
    workers.apply("ADDED", make_pod("w"))
    (change,) = workers.apply("MODIFIED", pod)
    assert (change.kind, change.reason) == ("leave", reason)
    assert workers.groups == {}


def test_a_pod_whose_ip_changes_is_a_new_group():
    workers = WorkerSet()
    workers.apply("ADDED", make_pod("w"))
    changes = workers.apply("MODIFIED", make_pod("w", ip="10.0.0.7"))
    assert [(c.kind, c.group.host) for c in changes] == [("leave", "10.0.0.1"),
                                                          ("join", "10.0.0.7")]


def test_addresses_of_ranks_ports_and_ipv6():
    group, _ = pod_group(make_pod("w", tp=2, grpc_port=7000, zmq_port=7001))
    assert group.addresses("grpc") == ["10.0.0.1:7000", "10.0.0.1:7002"]
    assert group.addresses("zmq") == ["10.0.0.1:7001", "10.0.0.1:7003"]
    group, _ = pod_group(make_pod("w", ip="fd00::5"))
    assert group.addresses("zmq") == ["[fd00::5]:50062"]
    pod = make_pod("w")
    pod["spec"]["containers"][0]["ports"] = []  # no named ports: the defaults
    assert pod_group(pod)[0].addresses("grpc") == ["10.0.0.1:50061"]


def test_resync_after_a_relist():
    workers, members = WorkerSet(), RecordingMembership()
    for name, ip in (("w-0", "10.0.0.1"), ("w-1", "10.0.0.2")):
        feed(workers, members, "ADDED", make_pod(name, ip=ip))
    # While the watch was down: w-0 went away, w-1 started terminating, w-2 came up.
    changes = workers.resync([make_pod("w-1", ip="10.0.0.2", deleting=True),
                              make_pod("w-2", ip="10.0.0.3")])
    assert [(c.kind, c.group.pod, c.reason) for c in changes] == [
        ("leave", "w-0", "gone"), ("leave", "w-1", "drain"), ("join", "w-2", "")]
    assert set(workers.groups) == {"w-2"}


def test_random_event_sequences_keep_the_set_right():
    """After every event the set is exactly the pods whose latest state serves."""
    rng = random.Random(0)
    workers, members = WorkerSet(), RecordingMembership()
    latest: dict[str, dict | None] = {}
    for _ in range(2000):
        name = f"w-{rng.randrange(5)}"
        event = rng.choice(["ADDED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"])
        pod = make_pod(name, ip=rng.choice(["", "10.0.0.1", "10.0.0.2"]),
                       phase=rng.choice(["Pending", "Running", "Running", "Failed"]),
                       ready=rng.random() < 0.7, deleting=rng.random() < 0.2,
                       uid=rng.choice(["a", "b"]))
        feed(workers, members, event, pod)
        latest[name] = None if event == "DELETED" else pod
        serving = {n for n, p in latest.items() if p is not None and pod_group(p)[0]}
        assert set(workers.groups) == serving == set(members.joined)
        for n in serving:
            assert members.joined[n] == pod_group(latest[n])[0]


# -- EngineMembership: joins and leaves reach the engine --------------------------------------


class FakeEngine:
    def __init__(self) -> None:
        self.replicas: dict[str, object] = {}
        self.detached: list[tuple[str, float | None]] = []
        self.lock = threading.Lock()

    def attach(self, executor, replica_id):
        with self.lock:
            assert replica_id not in self.replicas
            self.replicas[replica_id] = executor
        f: Future = Future()
        f.set_result(replica_id)
        return f

    def detach(self, replica_id, timeout_s=None):
        f: Future = Future()
        with self.lock:
            self.detached.append((replica_id, timeout_s))
            if self.replicas.pop(replica_id, None) is None:
                f.set_exception(KeyError(replica_id))
            else:
                f.set_result((0, 0))
        return f


class FakeExecutor:
    def __init__(self, addresses) -> None:
        self.addresses = addresses
        self.closed = False

    def shutdown(self) -> None:
        self.closed = True


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_engine_membership_attaches_and_detaches():
    engine = FakeEngine()
    members = EngineMembership(engine, lambda g: FakeExecutor(g.addresses("zmq")))
    workers = WorkerSet()
    for change in workers.apply("ADDED", make_pod("w-0")) + workers.apply(
            "ADDED", make_pod("w-1", ip="10.0.0.2")):
        members.join(change.group)
    wait_for(lambda: len(engine.replicas) == 2)
    assert sorted(e.addresses[0] for e in engine.replicas.values()) == [
        "10.0.0.1:50062", "10.0.0.2:50062"]
    (leave,) = workers.apply("MODIFIED", make_pod("w-0", deleting=True))
    members.leave(leave.group, leave.reason)
    (gone,) = workers.apply("MODIFIED", make_pod("w-1", ip=""))
    members.leave(gone.group, gone.reason)
    assert [t for _, t in engine.detached] == [None, 0.0]  # drain window, then at once
    assert engine.replicas == {}
    members.close()


def test_a_pod_that_leaves_while_connecting_is_detached_once_attached():
    engine = FakeEngine()
    connecting, release = threading.Event(), threading.Event()

    def slow_connect(group):
        connecting.set()
        release.wait(5)
        return FakeExecutor(group.addresses("grpc"))

    members = EngineMembership(engine, slow_connect)
    group, _ = pod_group(make_pod("w-0"))
    members.join(group)
    assert connecting.wait(5)
    members.leave(group, "gone")
    release.set()
    wait_for(lambda: len(engine.detached) == 2)
    assert engine.replicas == {}
    members.close()


def test_a_pod_back_from_not_ready_joins_under_a_new_replica_id():
    engine = FakeEngine()
    engine.detach = lambda rid, t=None: Future()  # the old replica is still draining
    members = EngineMembership(engine, lambda g: FakeExecutor(g.addresses("zmq")))
    group, _ = pod_group(make_pod("w-0"))
    members.join(group)
    wait_for(lambda: len(engine.replicas) == 1)
    members.leave(group, "drain")
    members.join(group)
    wait_for(lambda: len(engine.replicas) == 2)
    assert len(set(engine.replicas)) == 2
    members.close()


def test_a_failed_connection_is_retried_and_closed():
    engine = FakeEngine()
    made: list[FakeExecutor] = []

    def flaky(group):
        made.append(FakeExecutor(group.addresses("zmq")))
        if len(made) == 1:
            raise ConnectionError("not yet")
        return made[-1]

    members = EngineMembership(engine, flaky)
    members.join(pod_group(make_pod("w-0"))[0])
    wait_for(lambda: len(engine.replicas) == 1)
    assert len(made) == 2
    members.close()


# -- PodWatcher over the official client's watch, with a fake API ------------------------------


class FakeWatchResponse:
    status = 200

    def __init__(self, events: list[dict], hold: threading.Event | None) -> None:
        self.events, self.hold = events, hold

    def stream(self, amt=None, decode_content=False):
        for e in self.events:
            yield (json.dumps(e) + "\n").encode()
        if self.hold is not None:
            self.hold.wait(5)  # a watch with nothing new to say, until the test ends

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class FakeCoreV1:
    def __init__(self, listed: list[dict], events: list[dict]) -> None:
        from kubernetes import client

        self.client = client
        self.listed, self.events = listed, events
        self.calls: list[dict] = []
        self.hold = threading.Event()

    def list_namespaced_pod(self, namespace, **kwargs):
        """Lists pods.

        :return: V1PodList
        """
        self.calls.append({"namespace": namespace, **kwargs})
        if kwargs.get("watch"):
            events, self.events = self.events, []
            return FakeWatchResponse(events, self.hold)
        api = self.client.ApiClient()
        items = [api._ApiClient__deserialize(p, "V1Pod") for p in self.listed]
        return self.client.V1PodList(items=items,
                                     metadata=self.client.V1ListMeta(resource_version="7"))


def test_pod_watcher_lists_then_follows_the_watch():
    pytest.importorskip("kubernetes")
    api = FakeCoreV1(
        listed=[make_pod("w-0"), make_pod("w-1", ip="10.0.0.2", ready=False)],
        events=[{"type": "MODIFIED", "object": make_pod("w-1", ip="10.0.0.2")},
                {"type": "MODIFIED", "object": make_pod("w-0", deleting=True)},
                {"type": "ADDED", "object": make_pod("w-2", ip="10.0.0.3")},
                {"type": "MODIFIED", "object": make_pod("w-2", ip="", phase="Failed")}])
    members = RecordingMembership()
    watcher = PodWatcher(members, "app.kubernetes.io/component=worker", namespace="serving",
                         api=api).start()
    try:
        wait_for(lambda: len(members.log) == 5)
    finally:
        watcher.stop()
        api.hold.set()
    assert members.log == [("join", "w-0", ""), ("join", "w-1", ""), ("leave", "w-0", "drain"),
                           ("join", "w-2", ""), ("leave", "w-2", "gone")]
    assert set(members.joined) == {"w-1"}
    first, watch = api.calls[:2]
    assert first == {"namespace": "serving", "label_selector": "app.kubernetes.io/component=worker"}
    assert watch["watch"] is True and watch["resource_version"] == "7"
    assert watch["label_selector"] == first["label_selector"]


def test_the_first_pod_makes_the_engine_and_later_ones_attach():
    made: list[tuple[FakeExecutor, str]] = []

    def make_engine(executor, replica_id):
        engine = FakeEngine()
        engine.replicas[replica_id] = executor
        made.append((executor, replica_id))
        return engine

    members = EngineMembership(None, lambda g: FakeExecutor(g.addresses("zmq")),
                               make_engine=make_engine)
    with pytest.raises(TimeoutError):
        members.wait_engine(0.01)
    early, _ = pod_group(make_pod("w-9", ip="10.0.0.9"))
    members.leave(early, "gone")  # before any engine: nothing to do
    members.join(pod_group(make_pod("w-0"))[0])
    engine = members.wait_engine(5)
    members.join(pod_group(make_pod("w-1", ip="10.0.0.2"))[0])
    wait_for(lambda: len(engine.replicas) == 2)
    assert len(made) == 1 and made[0][1].startswith("w-0/")
    members.close()


def test_pod_watcher_through_the_official_client_over_http(monkeypatch, tmp_path):
    """The client's own config loading, list and chunked watch, against a stand-in API server."""
    from .fake_kube_api import FakeKubeApi, worker_pod

    labels = {"app.kubernetes.io/name": "batchwire", "app.kubernetes.io/component": "worker"}
    api = FakeKubeApi("serving")
    monkeypatch.setenv("KUBECONFIG", api.write_kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api.put(worker_pod("w-0", "serving", labels, 7000, 7001))
    api.put(worker_pod("other", "serving", {"app": "else"}, 1, 2))
    members = RecordingMembership()
    watcher = PodWatcher(members, ",".join(f"{k}={v}" for k, v in labels.items()),
                         namespace="serving").start()
    try:
        wait_for(lambda: members.log == [("join", "w-0", "")])
        assert members.joined["w-0"].addresses("zmq") == ["127.0.0.1:7001"]
        api.put(worker_pod("w-1", "serving", labels, 7002, 7003, ready=False))
        api.put(worker_pod("w-1", "serving", labels, 7002, 7003))
        api.put(worker_pod("w-0", "serving", labels, 7000, 7001, deleting=True))
        api.put(worker_pod("w-1", "serving", labels, 7002, 7003, ip="", phase="Failed"))
        wait_for(lambda: len(members.log) == 4)
    finally:
        watcher.stop()
        api.close()
    assert members.log[1:] == [("join", "w-1", ""), ("leave", "w-0", "drain"),
                               ("leave", "w-1", "gone")]
    assert any("watch=" in r for r in api.requests)
