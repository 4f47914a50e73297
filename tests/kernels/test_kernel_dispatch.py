"""Dispatch settings, and the package working where Triton is absent."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from batchwire import kernels
from batchwire.kernels import backend

REPO = Path(__file__).resolve().parents[2]


def test_set_backend_round_trip_and_rejects_unknown_names():
    before = kernels.get_backend()
    try:
        kernels.set_backend("torch")
        assert kernels.get_backend() == "torch"
        assert not backend.use_triton(torch.zeros(1))
        with pytest.raises(ValueError, match="'cuda-graphs'"):
            kernels.set_backend("cuda-graphs")
    finally:
        kernels.set_backend(before)


def test_auto_keeps_cpu_tensors_on_the_torch_path():
    before = kernels.get_backend()
    try:
        kernels.set_backend("auto")
        assert not backend.use_triton(torch.zeros(1))
    finally:
        kernels.set_backend(before)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_everything_imports_and_runs_without_triton():
    result = run_python(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` fail as if it were not installed
        import torch
        from batchwire import kernels
        from batchwire.kernels._triton import HAS_TRITON
        assert not HAS_TRITON
        out, res = kernels.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, torch.ones(2, 8))
        assert torch.allclose(out, torch.ones(2, 8)) and torch.equal(res, 2 * torch.ones(2, 8))
        try:
            kernels.set_backend("triton")
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "refused: kernel backend 'triton'" in result.stdout


def test_env_setting_is_read_and_checked():
    ok = run_python("from batchwire import kernels; print(kernels.get_backend())",
                    BATCHWIRE_KERNELS="torch")
    assert ok.returncode == 0 and ok.stdout.strip() == "torch"
    bad = run_python("import batchwire.kernels", BATCHWIRE_KERNELS="fast")
    assert bad.returncode != 0 and "BATCHWIRE_KERNELS='fast'" in bad.stderr
