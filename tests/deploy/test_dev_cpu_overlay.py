"""The dev-cpu overlay's containers really start and serve: their commands and environment are
read from the rendered manifests and run as local processes, with this test playing Kubernetes
(a stand-in API server for the scheduler's pod watch, the kubelet's gRPC probes, pod deletion
then SIGTERM). Requests stream while a worker is added and another removed; none is lost.

What differs from a pod, and why: every server binds a free port on 127.0.0.1 (the manifests'
fixed ports would collide on one machine), a worker runs one torch thread (the manifest's two
per pod assume a CPU limit each, not two pods on the same two cores), the pod IP is 127.0.0.1,
the ready file tells the test the bound ports, volume mounts become folders of the test, and
the kubeconfig points the scheduler's Kubernetes client at the stand-in API.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .fake_kube_api import FakeKubeApi, worker_pod
from .processes import Process

SERVING = health_pb2.HealthCheckResponse.SERVING
POD_IP = "127.0.0.1"
MAX_TOKENS = 12


def find(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def launch_spec(docs: list[dict], workload: dict, pod_name: str, tmp: Path,
                overrides: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The container's command and environment as the kubelet would give them, for a local
    process: ConfigMaps, then env in order with $(VAR) references and field references."""
    spec = workload["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    namespace = workload["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        env.update(cm["data"])
    fields = {"status.podIP": POD_IP, "metadata.namespace": namespace,
              "metadata.name": pod_name}
    for e in c.get("env", []):
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                                    e["value"])
    # Volume mounts become folders of the test; paths in the environment follow them.
    for mount in c.get("volumeMounts", []):
        local = tmp / pod_name / mount["mountPath"].strip("/").replace("/", "_")
        local.mkdir(parents=True, exist_ok=True)
        for k, v in env.items():
            if v == mount["mountPath"] or v.startswith(mount["mountPath"] + "/"):
                env[k] = str(local) + v[len(mount["mountPath"]):]
    env.update(overrides)
    command = list(c["command"]) + list(c.get("args", []))
    assert command[0] == "batchwire", command
    # The console script of this environment, as the image's PATH would find it.
    script = shutil.which("batchwire", path=os.path.dirname(sys.executable))
    command[:1] = [script] if script else [sys.executable, "-m", "scheduler_svc.cli"]
    base = {k: os.environ[k] for k in ("PATH", "LANG", "PYTHONPATH") if k in os.environ}
    return command, {**base, **env}


def probe(port: int, service: str) -> bool:
    """The kubelet's native gRPC probe."""
    try:
        with grpc.insecure_channel(f"{POD_IP}:{port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
            return reply.status == SERVING
    except grpc.RpcError:
        return False


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.1)


class Cluster:
    """The pods of the overlay, as local processes, and the API server that lists them."""

    def __init__(self, docs: list[dict], tmp: Path) -> None:
        self.docs, self.tmp = docs, tmp
        self.scheduler = find(docs, "Deployment")
        self.workers = find(docs, "StatefulSet")
        self.namespace = self.workers["metadata"]["namespace"]
        self.api = FakeKubeApi(self.namespace)
        self.kubeconfig = self.api.write_kubeconfig(tmp / "kubeconfig")
        self.processes: dict[str, Process] = {}

    def start_worker(self, name: str) -> dict:
        ready = self.tmp / f"{name}.ready.json"
        command, env = launch_spec(self.docs, self.workers, name, self.tmp, {
            # Pods share this host here, not a network namespace each: every port is a free one.
            "BATCHWIRE_PORT": "0", "BATCHWIRE_ZMQ_PORT": "0", "BATCHWIRE_METRICS_PORT": "0",
            "BATCHWIRE_READY_FILE": str(ready),
            # Nor a CPU limit each: two pods' OpenMP teams of the manifest's size on the same
            # two cores stall each other.
            "OMP_NUM_THREADS": "1",
        })
        process = Process(command, ready, self.tmp / f"{name}.log", env)
        self.processes[name] = process
        (rank,) = process.wait_ready()["ranks"]
        # Ready once the readiness probe (its service, on the gRPC port) says SERVING.
        (c,) = self.workers["spec"]["template"]["spec"]["containers"]
        service = c["readinessProbe"]["grpc"].get("service", "")
        wait_until(lambda: probe(rank["grpc_port"], service), 60, f"{name} ready")
        self.api.put(self.pod(name, rank))
        return rank

    def pod(self, name: str, rank: dict, **state) -> dict:
        labels = self.workers["spec"]["template"]["metadata"]["labels"]
        tp = int(self.workers["spec"]["template"]["metadata"]["annotations"][
            "batchwire.io/tensor-parallel-size"])
        return worker_pod(name, self.namespace, labels, rank["grpc_port"], rank["zmq_port"],
                          tensor_parallel_size=tp, **state)

    def start_scheduler(self) -> int:
        ready = self.tmp / "scheduler.ready.json"
        command, env = launch_spec(self.docs, self.scheduler, "batchwire-scheduler-0", self.tmp, {
            "BATCHWIRE_PORT": "0", "BATCHWIRE_METRICS_PORT": "0", "BATCHWIRE_HTTP_PORT": "0",
            "BATCHWIRE_READY_FILE": str(ready), "KUBECONFIG": self.kubeconfig,
        })
        process = Process(command, ready, self.tmp / "scheduler.log", env)
        self.processes["scheduler"] = process
        port = process.wait_ready()["port"]
        (c,) = self.scheduler["spec"]["template"]["spec"]["containers"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            service = c[kind]["grpc"].get("service", "")
            wait_until(lambda s=service: probe(port, s), 240,
                       f"scheduler {kind} passes:\n{process.log()}")
        return port

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop(grace_s=5)
        self.api.close()


class Load:
    """Clients streaming greedy completions, a few at a time, until told to stop."""

    def __init__(self, address: str, clients: int = 3, limit: int = 40) -> None:
        self.address = address
        self.results: list[tuple[str, int, str | None]] = []  # (finish, tokens, error)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i, limit), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, client: int, limit: int) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            for i in range(limit):
                if self.stopping.is_set():
                    return
                request = generate_pb2.GenerateRequest(
                    request_id=f"c{client}-{i}", text=f"Count from {i} to {i + 20}:",
                    sampling=generate_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                        ignore_eos=True))
                try:
                    tokens, finish = 0, None
                    for reply in stub.Generate(request, timeout=120):
                        tokens += len(reply.token_ids)
                        if reply.HasField("finish_reason"):
                            finish = reply.finish_reason
                    result = (finish or "none", tokens, None)
                except grpc.RpcError as e:
                    result = ("error", 0, f"{e.code().name}: {e.details()}")
                with self.lock:
                    self.results.append(result)

    def done(self) -> int:
        with self.lock:
            return len(self.results)

    def stop(self) -> list[tuple[str, int, str | None]]:
        self.stopping.set()
        for t in self.threads:
            t.join(180)
        return self.results


def worker_ports(address: str, states: tuple[int, ...] = (generate_pb2.WORKER_STATE_READY,)
                 ) -> set[int]:
    """The ports of the workers the scheduler reports in these states."""
    with grpc.insecure_channel(address) as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetServerInfo(
            generate_pb2.GetServerInfoRequest(), timeout=10)
    return {int(a.rpartition(":")[2]) for w in info.workers for a in w.address.split(",")
            if w.state in states}


def pre_stop_seconds(workload: dict) -> float:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


def test_dev_cpu_containers_serve_while_workers_come_and_go(dev_cpu, tmp_path):
    cluster = Cluster(dev_cpu, tmp_path)
    load = None
    try:
        first = cluster.start_worker("batchwire-worker-0")
        port = cluster.start_scheduler()
        address = f"{POD_IP}:{port}"
        transport = next(e["value"] for e in cluster.scheduler["spec"]["template"]["spec"][
            "containers"][0]["env"] if e["name"] == "BATCHWIRE_TRANSPORT")
        key = f"{transport}_port"
        assert worker_ports(address) == {first[key]}

        load = Load(address)
        wait_until(lambda: load.done() >= 3, 120, "first completions")
        # Scale up: a second pod starts, passes its probes and joins while requests stream.
        second = cluster.start_worker("batchwire-worker-1")
        wait_until(lambda: worker_ports(address) == {first[key], second[key]}, 60,
                   "the second worker joins")
        before = load.done()
        wait_until(lambda: load.done() >= before + 3, 120, "completions with two workers")
        # Scale down: the pod is marked for deletion and the scheduler drains it: no new request
        # goes there, its running ones finish. It must be gone from the scheduler within the
        # preStop sleep, after which the kubelet sends SIGTERM.
        cluster.api.put(cluster.pod("batchwire-worker-0", first, deleting=True))
        wait_until(lambda: worker_ports(address) == {second[key]}, 10, "worker-0 stops taking "
                   "requests")
        every_state = tuple(generate_pb2.WorkerState.values())
        wait_until(lambda: first[key] not in worker_ports(address, every_state),
                   pre_stop_seconds(cluster.workers), "worker-0 drained before its SIGTERM")
        cluster.processes["batchwire-worker-0"].signal(signal.SIGTERM)
        cluster.api.delete("batchwire-worker-0")
        before = load.done()
        wait_until(lambda: load.done() >= before + 3, 120, "completions after the removal")
        results = load.stop()
        load = None
        code = cluster.processes["batchwire-worker-0"].stop(grace_s=30)
        assert code == 0, cluster.processes["batchwire-worker-0"].log()
    finally:
        if load is not None:
            load.stop()
        cluster.stop()
    errors = [r for r in results if r[2] is not None]
    assert not errors, errors
    assert all(r[:2] == ("length", MAX_TOKENS) for r in results), results
    assert len(results) >= 9
