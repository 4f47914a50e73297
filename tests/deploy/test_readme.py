"""deploy/README.md, walked through as far as a machine without Docker or a cluster allows: its
commands parse as shell, each `docker build` names a Dockerfile target and tags the image the
overlay runs, `kind load` loads exactly those images, the kubectl commands name the overlay's
namespace, objects and ports as rendered, the model-cache Job validates and fills the folder the
overlays read, and nothing needs the standalone kustomize binary."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from .conftest import DEPLOY, render
from .test_dockerfile import stages

README = (DEPLOY / "README.md").read_text()
JOB = DEPLOY / "jobs" / "fill-model-cache.yaml"


def shell_block(heading: str) -> list[str]:
    """The commands of the first ```sh block after the heading, one per line."""
    after = README[README.index(heading):]
    block = after[after.index("```sh\n") + 6:].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


DEV_CPU = shell_block("## dev-cpu on a local kind cluster")
GPU = shell_block("## gpu: what the cluster needs first")


def words(line: str) -> list[str]:
    return shlex.split(line.split(" # ")[0].rstrip(" &"))


def option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_the_blocks_are_valid_shell():
    for block in (DEV_CPU, GPU):
        done = subprocess.run(["bash", "-n"], input="\n".join(block), capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_no_standalone_kustomize():
    for line in DEV_CPU + GPU:
        argv = words(line)
        assert "kustomize" not in argv or argv[:2] == ["kubectl", "kustomize"], line
    assert not re.search(r"(?<!kubectl )\bkustomize (build|edit)\b", README)


def test_dev_cpu_builds_and_loads_the_images_the_overlay_runs(dev_cpu):
    images = {c["image"] for d in dev_cpu if d["kind"] in ("Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    builds = [words(line) for line in DEV_CPU if line.startswith("docker build")]
    targets = {option(b, "--target")[0]: option(b, "-t")[0] for b in builds}
    assert set(targets) <= set(stages())
    assert set(targets.values()) == images == {"batchwire-worker-cpu:dev",
                                               "batchwire-scheduler:dev"}
    for b in builds:
        assert option(b, "-f") == ["deploy/Dockerfile"] and b[-1] == "."
        assert "WITH_DEFAULT_MODEL=1" in option(b, "--build-arg")  # dev-cpu mounts no model
    # The worker image is the CPU target, not the CUDA one.
    assert targets["worker-cpu"] == "batchwire-worker-cpu:dev"
    assert stages()["worker-cpu"].startswith("${PYTHON_IMAGE}")
    assert "download.pytorch.org/whl/cpu" in stages()["worker-cpu"]

    (load,) = [words(line) for line in DEV_CPU if line.startswith("kind load docker-image")]
    (create,) = [words(line) for line in DEV_CPU if line.startswith("kind create cluster")]
    assert set(load[3:load.index("--name")]) == images
    assert option(load, "--name") == option(create, "--name")


def test_dev_cpu_kubectl_commands_match_the_rendered_overlay(dev_cpu):
    kubectl_lines = [words(line) for line in DEV_CPU if line.startswith("kubectl")]
    assert ["kubectl", "apply", "-k", "deploy/overlays/dev-cpu"] in kubectl_lines
    assert ["kubectl", "kustomize", "deploy/overlays/dev-cpu"] in kubectl_lines
    (namespace,) = {d["metadata"]["name"] for d in dev_cpu if d["kind"] == "Namespace"}
    objects = {(d["kind"].lower(), d["metadata"]["name"]) for d in dev_cpu}
    for argv in kubectl_lines:
        if "-n" in argv:
            assert option(argv, "-n") == [namespace], argv
        for ref in (a for a in argv[2:] if re.fullmatch(r"[a-z]+/[a-z-]+", a)):
            kind, name = ref.split("/")
            kind = {"svc": "service"}.get(kind, kind)
            assert (kind, name) in objects, ref
    (forward,) = [a for a in kubectl_lines if "port-forward" in a]
    local, remote = forward[-1].split(":")
    service = next(d for d in dev_cpu if d["kind"] == "Service"
                   and d["metadata"]["name"] == "batchwire-scheduler")
    assert int(remote) in {p["port"] for p in service["spec"]["ports"]}
    (call,) = [words(line) for line in DEV_CPU if line.startswith("batchwire ")]
    assert option(call, "--address") == [f"localhost:{local}"] and call[1] == "generate"


def test_the_gpu_prerequisites_are_listed():
    section = README[README.index("## gpu: what the cluster needs first"):]
    section = section[:section.index("\n## ", 1)]
    for needed in ("cert-manager", "Prometheus Operator", "prometheus-adapter",
                   "prometheus-adapter-rules.yaml", "device plugin", "ReadWriteMany"):
        assert needed in section, needed


def test_the_model_cache_job_fills_the_folder_the_overlay_reads(kubectl, tmp_path):
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", str(JOB)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "passed" in done.stdout, done.stdout + done.stderr
    job = yaml.safe_load(JOB.read_text())
    gpu = [d for d in yaml.safe_load_all(render(kubectl, "gpu")) if d]
    (claim,) = [d for d in gpu if d["kind"] == "PersistentVolumeClaim"]
    pod = job["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert not volume["persistentVolumeClaim"].get("readOnly")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    config = next(d for d in gpu if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"].startswith("batchwire-model"))
    model = config["data"]["BATCHWIRE_MODEL"]
    script = " ".join(pod["containers"][0]["args"])
    assert model.startswith(mount["mountPath"] + "/") and f"mv {model}.partial {model}" in script
    assert pod["securityContext"]["runAsUser"] == 10001
    # The README's gpu commands create the claim alone (by its label), then run the Job.
    lines = [words(line) for line in GPU]
    selector = next(option(a, "-l") for a in lines if "-l" in a)
    key, value = selector[0].split("=")
    assert claim["metadata"]["labels"][key] == value
    labelled = [d for d in gpu if d["metadata"].get("labels", {}).get(key) == value]
    assert labelled == [claim]
    assert ["kubectl", "-n", claim["metadata"]["namespace"], "apply", "-f",
            "deploy/jobs/fill-model-cache.yaml"] in lines
    assert lines.index(["kubectl", "apply", "-k", "deploy/overlays/gpu"]) > next(
        i for i, a in enumerate(lines) if "wait" in a)


@pytest.mark.parametrize("target", ["worker", "worker-cpu", "scheduler"])
def test_every_image_the_readme_builds_exists(target):
    builds = [words(line) for line in DEV_CPU + GPU if line.startswith("docker build")]
    assert target in {option(b, "--target")[0] for b in builds}
