"""The Makefile's targets do what their names say; none of these runs the setup (a stamp file
newer than pyproject.toml stands in for it) or touches the repository's own files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make(cwd: Path, stamp: Path, *targets: str) -> subprocess.CompletedProcess:
    stamp.touch()  # newer than pyproject.toml: the setup rule does not run
    return subprocess.run(["make", "-s", f"STAMP={stamp}", f"PY={sys.executable}", *targets],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_bare_make_lists_every_target(tmp_path):
    done = _make(REPO, tmp_path / "stamp")
    assert done.returncode == 0, done.stderr
    for target in ("setup", "run", "test", "test-fast", "protos", "check-protos", "lint",
                   "bench", "clean"):
        assert f"make {target} " in done.stdout, done.stdout


def test_every_phony_target_has_a_recipe():
    done = subprocess.run(["make", "-p", "-n", "-f", "Makefile", "help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    phony = next(line for line in done.stdout.splitlines() if line.startswith(".PHONY:"))
    for target in phony.split(":", 1)[1].split():
        dry = subprocess.run(["make", "-n", "STAMP=/dev/null", target], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert "Nothing to be done" not in dry.stdout + dry.stderr, target


def test_check_protos_passes_when_current_and_fails_when_stale(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "Makefile", copy)
    shutil.copy(REPO / "pyproject.toml", copy)
    shutil.copytree(REPO / "protos", copy / "protos",
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = _make(copy, tmp_path / "stamp", "check-protos")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "current" in done.stdout
    generated = copy / "protos" / "batchwire" / "v1" / "generate_pb2.py"
    generated.write_text(generated.read_text() + "\n# edited by hand\n")
    done = _make(copy, tmp_path / "stamp", "check-protos")
    assert done.returncode != 0
    assert "generate_pb2.py" in done.stdout and "make protos" in done.stdout


def test_test_fast_leaves_out_the_slow_tests(tmp_path):
    dry = _make(REPO, tmp_path / "stamp", "-n", "test-fast")
    assert "-m 'not slow'" in dry.stdout, dry.stdout
