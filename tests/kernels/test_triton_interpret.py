"""Runs tests/kernels/interpreted in its own process under the Triton interpreter.

TRITON_INTERPRET is read when Triton is imported, so it cannot be switched on inside this
process without leaking into every other test.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.kernels._triton import HAS_TRITON

INTERPRETED = Path(__file__).resolve().parent / "interpreted"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "BATCHWIRE_KERNELS": "auto"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(INTERPRETED), "-q", "-p", "no:cacheprovider"],
        cwd=INTERPRETED.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
