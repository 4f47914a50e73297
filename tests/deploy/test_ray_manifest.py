"""deploy/ray, batchwire on a KubeRay RayCluster, renders; its Service and pod templates (as
Pods) validate against the Kubernetes schemas; the scheduler beside Ray's head runs `batchwire
serve --transport ray` with options the CLI accepts, on the head's GCS port, with one Ray worker
pod per replica; the Service reaches the scheduler's ports on the head pod."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from scheduler_svc.cli.commands import build_parser

from .conftest import DEPLOY
from .test_manifests import K8S_VERSIONS, one, selects, validate_strictly


@pytest.fixture(scope="module")
def ray_docs(kubectl) -> list[dict]:
    done = subprocess.run([kubectl, "kustomize", str(DEPLOY / "ray")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize deploy/ray failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def pod_templates(cluster: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"]
                                                  for g in spec["workerGroupSpecs"]]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_service_and_pod_templates_validate_strictly(ray_docs, version, tmp_path):
    cluster = one(ray_docs, "RayCluster", "batchwire")
    assert cluster["apiVersion"] == "ray.io/v1"
    # The RayCluster's schema is KubeRay's; the pods it makes are checked as Pods.
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"template-{i}"},
             "spec": t["spec"]} for i, t in enumerate(pod_templates(cluster))]
    builtin = [d for d in ray_docs if d["kind"] != "RayCluster"] + pods
    validate_strictly(builtin, version, tmp_path / "ray.yaml")


def test_the_scheduler_beside_the_head_serves_over_ray(ray_docs):
    cluster = one(ray_docs, "RayCluster", "batchwire")
    head = cluster["spec"]["headGroupSpec"]
    ray_head, scheduler = head["template"]["spec"]["containers"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no rank on the head
    command = scheduler["command"]
    assert command[:2] == ["batchwire", "serve"]
    args = build_parser().parse_args(command[1:])
    assert args.transport == "ray"
    gcs = next(p["containerPort"] for p in ray_head["ports"] if p["name"] == "gcs")
    assert args.ray_address == f"127.0.0.1:{gcs}"
    # One worker pod of one CPU bundle per replica of one rank: the replicas spread.
    pods = sum(g["replicas"] for g in cluster["spec"]["workerGroupSpecs"])
    bundles = sum(int(g["rayStartParams"]["num-cpus"]) * g["replicas"]
                  for g in cluster["spec"]["workerGroupSpecs"])
    assert args.replicas == pods == bundles
    ports = {p["name"]: p["containerPort"] for p in scheduler["ports"]}
    assert ports["grpc"] == args.port and ports["http"] == args.http_port


def test_service_reaches_the_head_pods_scheduler(ray_docs):
    service = one(ray_docs, "Service", "batchwire")
    cluster = one(ray_docs, "RayCluster", "batchwire")
    # The labels KubeRay gives the head pod.
    head_labels = {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert selects(service["spec"]["selector"], head_labels)
    scheduler = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    named = {p["name"] for p in scheduler["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
