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


def test_mypy_passes(tmp_path):
    result = run("mypy", "--cache-dir", str(tmp_path), *CODE)
    assert result.returncode == 0, result.stdout + result.stderr
