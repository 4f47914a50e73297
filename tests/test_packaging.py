"""The distribution built from the repository installs the project's own import names: the
repository's kernels/ and benchmarks/ folders import as batchwire.kernels and batchwire.benchmarks,
nothing named plain `kernels` or `benchmarks` lands in site-packages, and `from batchwire import
LLM, SamplingParams` works. Checked in a fresh virtual environment, offline: the wheel is built with
the test environment's setuptools and installed without dependencies; the dependencies (torch,
transformers, ...) are then read from the test environment's site-packages, listed after the new
environment's own so that batchwire itself comes from the install."""

from __future__ import annotations

import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "protos", "common", "scheduler_svc", "worker_svc",
           "kernels", "benchmarks"]

CHECK = """
import importlib.util, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
import batchwire.common.model_files, batchwire.v1.generate_pb2
assert "torch" not in sys.modules  # the package's front door loads nothing until asked
import batchwire.kernels, batchwire.benchmarks
for module in (batchwire, batchwire.kernels, batchwire.benchmarks, batchwire.common):
    assert module.__file__.startswith(site), module.__file__
from batchwire import LLM, SamplingParams
from batchwire.kernels import AttentionMetadata
from batchwire.benchmarks.shared.workloads import w64
from batchwire.benchmarks.__main__ import BENCHMARKS  # how `batchwire bench` finds each one
for name, (module, _) in BENCHMARKS.items():  # its sub-packages are in the wheel too
    assert importlib.util.find_spec(f"batchwire.benchmarks.{module}"), name
assert importlib.util.find_spec("batchwire.benchmarks.gpu.kernels_gpu")  # a script, not one
print("top-level:", sorted(n for n in os.listdir(site) if not n.endswith((".pth", ".py"))))
print("kernels spec:", importlib.util.find_spec("kernels"))
print("benchmarks spec:", importlib.util.find_spec("benchmarks"))
print("LLM:", LLM.__module__, SamplingParams(max_tokens=3).max_tokens, len(w64()))
missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None
           or not importlib.util.find_spec(name).origin.startswith(site)]
assert not missing, f"not in the wheel: {missing}"  # every package folder of the repository
native = os.path.dirname(importlib.util.find_spec("worker_svc.native").origin)
print("native sources:", sorted(n for n in os.listdir(native) if n.endswith((".c", ".h"))))
"""

# Where each repository folder installs (pyproject.toml's package-dir).
INSTALLED_AS = {"protos/batchwire": "batchwire", "common": "batchwire.common",
                "kernels": "batchwire.kernels", "benchmarks": "batchwire.benchmarks"}


def repository_packages() -> list[str]:
    """Every folder of the repository with an __init__.py, by the name it imports as."""
    names = []
    for init in sorted(ROOT.glob("*/**/__init__.py")):
        folder = init.parent.relative_to(ROOT).as_posix()
        if folder.startswith(("tests", "deploy", ".venv", "build")):
            continue
        top = next((k for k in sorted(INSTALLED_AS, key=len, reverse=True)
                    if folder == k or folder.startswith(k + "/")), None)
        name = (INSTALLED_AS[top] + folder[len(top):] if top else folder).replace("/", ".")
        names.append(name)
    return names


def copy_sources(dest: pathlib.Path) -> None:
    """The files a clean clone has: no build outputs, and no local links (a checkout may link
    protos/batchwire/common to common/ for running from the source tree)."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in ("__pycache__", "build") or n.endswith(".egg-info")
                or os.path.islink(os.path.join(folder, n))}

    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy(source, dest / name)


def run(*cmd: str, cwd: pathlib.Path, env: dict | None = None) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_fresh_environment_gets_the_projects_own_import_names(tmp_path):
    source, wheels, venv = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv"
    source.mkdir()
    copy_sources(source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
        str(source), cwd=tmp_path)
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python = str(venv / "bin" / "python")
    wheel = next(wheels.glob("batchwire-*.whl"))
    run(*pip, "--python", python, "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)

    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                  cwd=tmp_path).strip()
    # The dependencies, after the new environment's own site-packages (a path line in a .pth is
    # appended to sys.path; .pth files inside it, such as an editable install's, are not run).
    (pathlib.Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    packages = repository_packages()
    assert {"worker_svc.native", "batchwire.benchmarks.offline"} <= set(packages)
    out = run(python, "-c", f"PACKAGES = {packages!r}\n{CHECK}", cwd=tmp_path, env=env)

    top_level = next(line for line in out.splitlines() if line.startswith("top-level:"))
    assert "'batchwire'" in top_level
    assert "'kernels'" not in top_level and "'benchmarks'" not in top_level, top_level
    assert "kernels spec: None" in out and "benchmarks spec: None" in out, out
    assert "LLM: scheduler_svc.engine.llm 3 64" in out, out
    # Every C source beside decode.c in the repository (library.py compiles them at first use).
    sources = sorted(p.name for p in (ROOT / "worker_svc" / "native").glob("*.[ch]"))
    assert {"decode.c", "products.h"} <= set(sources)
    assert f"native sources: {sources}" in out, out
    assert sysconfig.get_paths()["purelib"] != purelib  # a new environment, not this one
