"""`make run` installs what serving needs and no more: batchwire's own dependencies (and Triton
on a GPU machine), not the dev extra that `make test` adds (test, lint and benchmark tools, a
few GB). Checked without installing anything: the setup command `make -n run` would run, and
every module the serving code imports (read from its source, imports inside functions too)
against the distributions that install brings, resolved from this environment's metadata."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SERVING_CODE = ("scheduler_svc", "worker_svc", "common", "kernels", "protos/batchwire")
FIRST_PARTY = {"batchwire", "scheduler_svc", "worker_svc"}


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements install, followed through this environment."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = _name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            sub = Requirement(text)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return seen


def _requirements(extra: str | None) -> list[Requirement]:
    reqs = [Requirement(r) for r in metadata.distribution("batchwire").requires or []]
    return [r for r in reqs if (r.marker is None) == (extra is None)
            and (extra is None or r.marker.evaluate({"extra": extra}))]


def _imported_top_level_names() -> dict[str, str]:
    """Top-level module name -> a file that imports it, for all serving code."""
    names: dict[str, str] = {}
    for folder in SERVING_CODE:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found = [node.module]
                else:
                    continue
                for module in found:
                    names.setdefault(module.split(".")[0], str(path.relative_to(ROOT)))
    return names


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_run_installs_batchwire_without_the_dev_extra(tmp_path):
    dry = subprocess.run(["make", "-n", f"RUN_STAMP={tmp_path / 'none'}", "TRITON=", "run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    installs = [line for line in dry.stdout.splitlines() if " install " in line]
    assert any("install -q -e '.'" in line for line in installs), dry.stdout
    assert not any("dev" in line for line in installs), dry.stdout
    gpu = subprocess.run(["make", "-n", f"RUN_STAMP={tmp_path / 'none'}", "TRITON=[triton]",
                          "run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "install -q -e '.[triton]'" in gpu.stdout, gpu.stdout
    everything = subprocess.run(["make", "-n", f"STAMP={tmp_path / 'none'}", "setup"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "install -q -e '.[dev,triton]'" in everything.stdout, everything.stdout


def test_the_serving_install_has_every_module_serving_imports_and_no_dev_tool():
    serving = _closure(_requirements(None))
    optional = {}  # a non-dev extra's distributions: imported behind a guard or a flag
    extras = metadata.distribution("batchwire").metadata.get_all("Provides-Extra") or []
    for extra in extras:
        if extra != "dev":
            for dist in _closure(_requirements(extra)):
                optional.setdefault(dist, extra)
    providers = {module: {_name(d) for d in dists}
                 for module, dists in metadata.packages_distributions().items()}

    missing = {}
    for module, where in _imported_top_level_names().items():
        if module in sys.stdlib_module_names or module in FIRST_PARTY:
            continue
        dists = providers.get(module, set())
        if not dists & (serving | set(optional)):
            missing[module] = (where, sorted(dists) or "not installed here")
    assert not missing, f"serving code imports what `make run` does not install: {missing}"

    dev_only = _closure(_requirements("dev")) - serving - set(optional)
    for tool in ("pytest", "mypy", "ruff", "lm-eval", "schemathesis", "hypothesis",
                 "matplotlib", "grpcio-tools"):
        assert tool in dev_only, tool  # the dev extra's, and not pulled in by serving
