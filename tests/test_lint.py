"""`make lint` passes: ruff over the code and tests, mypy over the code that ships."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = ["scheduler_svc", "worker_svc", "kernels", "benchmarks", "common"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_passes():
    result = run("ruff", "check", *CODE, "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_passes():
    # The repository's own .mypy_cache, as `make lint` uses: a fresh clone's first run analyses
    # torch and the rest (90 s on 2 cores); a later one rechecks only the files that changed
    # since (3 s), which mypy's incremental mode checks as fully as a fresh run.
    result = run("mypy", *CODE)
    assert result.returncode == 0, result.stdout + result.stderr
