"""The kustomize overlays render, validate against the Kubernetes schemas, and keep the
deployment's invariants (probes, drain, shared memory, selectors, RBAC, autoscaler, policies)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import DEPLOY, OVERLAYS, render

# Custom resources: their schemas belong to the operators that define them, not to Kubernetes,
# so kubernetes-validate has none. They are checked by the tests below instead.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor"}
# The oldest Kubernetes these manifests are for (native gRPC probes, NetworkPolicy endPort,
# autoscaling/v2 are all GA by then) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", None)
WORKER_LABELS = {"app.kubernetes.io/name": "batchwire", "app.kubernetes.io/component": "worker"}
SCHEDULER_LABELS = {"app.kubernetes.io/name": "batchwire",
                    "app.kubernetes.io/component": "scheduler"}


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return find(docs, "Deployment") + find(docs, "StatefulSet")


def scheduler(docs):
    return one(docs, "Deployment", "batchwire-scheduler")


def workers(docs):
    return one(docs, "StatefulSet", "batchwire-worker")


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env(workload: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment: its ConfigMaps, then its own variables."""
    c, out = container(workload), {}
    for source in c.get("envFrom", []):
        out.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        out[e["name"]] = e.get("value", "")
    return out


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def pre_stop_seconds(c: dict) -> int:
    pre_stop = c.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", f"preStop is not a sleep: {command}"
    return int(command[1])


# -- rendering and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_validates_strictly(docs, overlay, version, tmp_path):
    validate_strictly([d for d in docs if d["kind"] not in CUSTOM_KINDS], version,
                      tmp_path / f"{overlay}.yaml")


def validate_strictly(builtin: list[dict], version: str | None, path: Path) -> None:
    """kubernetes-validate --strict passes every document, with no warning."""
    path.write_text(yaml.safe_dump_all(builtin))
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", str(path)]
    if version:
        cmd[3:3] = ["-k", version]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    report = done.stdout + done.stderr
    assert done.returncode == 0 and "ERROR" not in report and "WARN" not in report, report
    assert report.count("passed") == len(builtin)


def test_every_component_is_in_some_overlay(kubectl):
    used = set()
    for overlay in OVERLAYS:
        for path in (DEPLOY / "overlays" / overlay).glob("kustomization.yaml"):
            used |= {Path(c).name for c in yaml.safe_load(path.read_text()).get("components", [])}
    assert used == {p.name for p in (DEPLOY / "components").iterdir() if p.is_dir()}
    assert {"dev-cpu", "gpu"} <= set(OVERLAYS)


def test_base_renders_alone(kubectl):
    done = subprocess.run([kubectl, "kustomize", str(DEPLOY / "base")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- pods ---------------------------------------------------------------------------------------


def test_probes_are_native_grpc_on_container_ports(docs):
    for w in workloads(docs):
        c = container(w)
        ports = {p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{w['metadata']['name']}: no {probe}"
            port = c[probe]["grpc"]["port"]
            assert type(port) is int and port in ports, (w["metadata"]["name"], probe, port)
        # Liveness only runs once the startup probe has passed: a loading pod is not killed.
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 30


def test_worker_startup_probe_is_sized_for_model_load(docs, overlay):
    probe = container(workers(docs))["startupProbe"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget >= (300 if overlay == "dev-cpu" else 1200), budget


def test_worker_readiness_is_the_worker_service(docs):
    probe = container(workers(docs))["readinessProbe"]["grpc"]
    assert probe.get("service") == "batchwire.v1.Worker"


def test_grace_period_covers_pre_stop_and_drain(docs):
    from worker_svc.server.serve import ServeOptions  # the worker's own shutdown grace

    s, w = scheduler(docs), workers(docs)
    s_env = env(s, docs)
    s_spec = s["spec"]["template"]["spec"]
    assert s_spec["terminationGracePeriodSeconds"] >= (
        pre_stop_seconds(container(s)) + float(s_env["BATCHWIRE_DRAIN_TIMEOUT"]))
    # A leaving worker stays up while the scheduler lets its running requests finish ...
    w_pre_stop = pre_stop_seconds(container(w))
    assert w_pre_stop >= float(s_env["BATCHWIRE_WORKER_DRAIN_TIMEOUT"])
    # ... then SIGTERM leaves it its own grace to answer the call in progress.
    assert w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= (
        w_pre_stop + ServeOptions().grace_s)


def test_worker_shared_memory_and_writable_caches(docs):
    w = workers(docs)
    spec, c = w["spec"]["template"]["spec"], container(w)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory" and "sizeLimit" in shm["emptyDir"]
    writable = [p for p, m in mounts.items()
                if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")]
    e = env(w, docs)
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR",
                "TORCHINDUCTOR_CACHE_DIR"):
        assert any(e[var] == p or e[var].startswith(p + "/") for p in writable), (var, e[var])
    assert "/tmp" in writable


def test_non_root_and_read_only_root(docs):
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        sc = container(w)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]


def test_gpus_requested_as_limited(docs, overlay):
    w = workers(docs)
    resources = container(w)["resources"]
    gpus = resources.get("limits", {}).get("nvidia.com/gpu")
    assert resources.get("requests", {}).get("nvidia.com/gpu") == gpus
    e = env(w, docs)
    if overlay == "dev-cpu":
        assert gpus is None and e["BATCHWIRE_DEVICE"] == "cpu"
        return
    tp = int(e.get("BATCHWIRE_TENSOR_PARALLEL_SIZE", 1))
    assert int(gpus) == tp and e["BATCHWIRE_DEVICE"] == "cuda"
    annotations = w["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["batchwire.io/tensor-parallel-size"]) == tp
    ports = {p["containerPort"] for p in container(w)["ports"]}
    grpc_port, zmq_port = int(e["BATCHWIRE_PORT"]), int(e["BATCHWIRE_ZMQ_PORT"])
    for rank in range(tp):  # the launcher's convention: rank r on port + 2r
        assert {grpc_port + 2 * rank, zmq_port + 2 * rank} <= ports


def test_servers_bind_the_pod_address(docs):
    for w in workloads(docs):
        c = container(w)
        values = {e["name"]: e for e in c["env"]}
        assert values["BATCHWIRE_HOST"]["value"] == "$(POD_IP)"
        assert values["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("BATCHWIRE_HOST")  # $(...) sees only earlier


def test_scheduler_and_workers_share_the_model_settings(docs):
    s, w = env(scheduler(docs), docs), env(workers(docs), docs)
    for name in ("BATCHWIRE_MODEL", "BATCHWIRE_DTYPE", "BATCHWIRE_BLOCK_SIZE",
                 "BATCHWIRE_MAX_MODEL_LEN", "BATCHWIRE_MAX_NUM_BATCHED_TOKENS"):
        assert s.get(name) == w.get(name), name
    assert s["BATCHWIRE_MAX_NUM_SEQS"] == w["BATCHWIRE_MAX_NUM_REQS"]
    model = s.get("BATCHWIRE_MODEL")
    if model:
        for wl in (scheduler(docs), workers(docs)):
            mounts = [m["mountPath"] for m in container(wl)["volumeMounts"]]
            assert any(model.startswith(m + "/") for m in mounts), (wl["metadata"]["name"], model)


def test_secret_files_are_mounted(docs):
    for w in workloads(docs):
        c, spec = container(w), w["spec"]["template"]["spec"]
        secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        for e in c["env"]:
            if re.search(r"TLS_(CERT|KEY|CA)$|API_KEY_FILE$|TOKEN_FILE$", e["name"]):
                folder = e["value"].rsplit("/", 1)[0]
                assert mounts.get(folder) in secrets, (e["name"], e["value"])


# -- selectors, services, budgets ---------------------------------------------------------------


def test_workload_selectors_match_their_pods(docs):
    for w in workloads(docs):
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w))


def test_services_select_pods_and_name_their_ports(docs):
    for svc in find(docs, "Service"):
        matched = [w for w in workloads(docs) if selects(svc["spec"]["selector"], pod_labels(w))]
        assert len(matched) == 1, svc["metadata"]["name"]
        ports = {p["name"]: p["containerPort"] for p in container(matched[0])["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    headless = one(docs, "Service", "batchwire-worker")
    assert headless["spec"]["clusterIP"] == "None"
    assert workers(docs)["spec"]["serviceName"] == "batchwire-worker"


def test_disruption_budgets_select_their_pods(docs):
    budgets = find(docs, "PodDisruptionBudget")
    assert {b["metadata"]["name"] for b in budgets} == {"batchwire-scheduler", "batchwire-worker"}
    for b in budgets:
        matched = [w for w in workloads(docs)
                   if selects(b["spec"]["selector"]["matchLabels"], pod_labels(w))]
        assert [w["metadata"]["name"] for w in matched] == [b["metadata"]["name"]]


def test_rbac_covers_the_discovery_calls(docs):
    s = scheduler(docs)
    spec = s["spec"]["template"]["spec"]
    account = spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is True
    assert workers(docs)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    binding = one(docs, "RoleBinding", account)
    assert {"kind": "ServiceAccount", "name": account} == {
        k: v for k, v in binding["subjects"][0].items() if k in ("kind", "name")}
    role = one(docs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    # PodWatcher calls list_namespaced_pod, then the same as a watch.
    assert any("" in r["apiGroups"] and "pods" in r["resources"]
               and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert verbs <= {"get", "list", "watch"}, "the scheduler only reads"
    # The discovery selector picks the worker pods and nothing else.
    selector = dict(kv.split("=", 1) for kv in
                    env(s, docs)["BATCHWIRE_DISCOVER_WORKERS"].split(","))
    assert selects(selector, pod_labels(workers(docs)))
    assert not selects(selector, pod_labels(s))


# -- components ---------------------------------------------------------------------------------


def test_autoscaler_targets_the_worker_statefulset(docs, overlay):
    hpas = find(docs, "HorizontalPodAutoscaler")
    if overlay == "dev-cpu":
        assert not hpas
        return
    (hpa,) = hpas
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    w = workers(docs)
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "StatefulSet",
                                                            w["metadata"]["name"])
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] >= 60
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    # The metrics are ones the scheduler exports.
    from scheduler_svc.service.metrics import SchedulerMetrics

    exported = {m.name for m in SchedulerMetrics().registry.collect()}
    names = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {"batchwire_num_requests_waiting", "batchwire_kv_cache_usage_ratio"}
    assert names <= exported


def test_service_monitor_scrapes_the_scheduler_metrics_port(docs, overlay):
    monitors = find(docs, "ServiceMonitor")
    if overlay == "dev-cpu":
        assert not monitors
        return
    (monitor,) = monitors
    svc = one(docs, "Service", "batchwire-scheduler")
    assert selects(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert "metrics" in port_names


def _allowed_ports(rule: dict) -> set[int]:
    out = set()
    for p in rule.get("ports", []):
        out |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
    return out


def test_network_policies_allow_only_the_links(docs):
    policies = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}
    w, s = workers(docs), scheduler(docs)
    for wl in (w, s):  # every batchwire pod is confined
        assert any(selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(wl))
                   and {"Ingress", "Egress"} <= set(p["spec"]["policyTypes"])
                   for p in policies.values())
    worker_policy = policies["batchwire-worker"]
    rule, scrape = worker_policy["spec"]["ingress"]  # the scheduler's calls; Prometheus
    (peer,) = rule["from"]
    assert selects(peer["podSelector"]["matchLabels"], pod_labels(s))
    assert not selects(peer["podSelector"]["matchLabels"], pod_labels(w))
    e = env(w, docs)
    tp = int(e.get("BATCHWIRE_TENSOR_PARALLEL_SIZE", 1))
    needed = {int(e["BATCHWIRE_PORT"]) + 2 * r for r in range(tp)} | {
        int(e["BATCHWIRE_ZMQ_PORT"]) + 2 * r for r in range(tp)}
    assert needed <= _allowed_ports(rule)
    (prometheus,) = scrape["from"]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    metrics_port = int(e.get("BATCHWIRE_METRICS_PORT", 9091))
    assert {metrics_port + r for r in range(tp)} <= _allowed_ports(scrape)
    assert not needed & _allowed_ports(scrape)  # Prometheus reaches no step port
    scheduler_policy = policies["batchwire-scheduler"]
    by_port = {frozenset(_allowed_ports(r)): r for r in scheduler_policy["spec"]["ingress"]}
    assert "from" not in by_port[frozenset({50051})]  # clients, from anywhere
    assert "from" not in by_port[frozenset({8000})]  # and over the HTTP API
    metrics = by_port[frozenset({9090})]["from"][0]
    assert metrics["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert len(by_port) == 3
    assert worker_policy["spec"]["egress"] and all(
        _allowed_ports(r) == {53} for r in worker_policy["spec"]["egress"])


def test_tls_overlay_probes_the_plaintext_health_port(kubectl):
    docs = [d for d in yaml.safe_load_all(render(kubectl, "gpu")) if d]
    for w in workloads(docs):
        e = env(w, docs)
        health = int(e["BATCHWIRE_HEALTH_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container(w)[probe]["grpc"]["port"] == health
    assert env(workers(docs), docs)["BATCHWIRE_NO_ZMQ"] == "1"
    assert env(scheduler(docs), docs)["BATCHWIRE_TRANSPORT"] == "grpc"


def test_scheduler_and_workers_read_one_worker_token_secret(kubectl):
    docs = [d for d in yaml.safe_load_all(render(kubectl, "gpu")) if d]
    sources = []
    for w in (scheduler(docs), workers(docs)):
        path = env(w, docs)["BATCHWIRE_WORKER_TOKEN_FILE"]
        folder, key = path.rsplit("/", 1)
        (mount,) = [m for m in container(w)["volumeMounts"] if m["mountPath"] == folder]
        assert mount.get("readOnly") is True, mount
        (volume,) = [v for v in w["spec"]["template"]["spec"]["volumes"]
                     if v["name"] == mount["name"]]
        sources.append((volume["secret"]["secretName"], key))
    assert sources == [("batchwire-worker-token", "worker-token")] * 2


def test_torch_threads_fit_the_cpu_limit(docs):
    w = workers(docs)
    e = env(w, docs)
    cpus = float(container(w)["resources"]["limits"]["cpu"])
    ranks = int(e.get("BATCHWIRE_TENSOR_PARALLEL_SIZE", 1))
    assert 1 <= int(e["OMP_NUM_THREADS"]) * ranks <= cpus


def test_pod_monitor_scrapes_each_worker_pods_metrics_port(docs, overlay):
    monitors = find(docs, "PodMonitor")
    if overlay == "dev-cpu":
        assert not monitors
        return
    (monitor,) = monitors
    workers = [d for d in find(docs, "Deployment") + find(docs, "StatefulSet")
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    assert workers
    for w in workers:
        template = w["spec"]["template"]
        assert selects(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert ports.get("metrics") == 9091  # worker_svc's default --metrics-port
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
