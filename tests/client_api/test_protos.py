"""The .proto files: buf lint passes with only the documented exceptions, and the checked-in
generated code is what `make protos` would generate now."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.client_api.server_process import REPO

PROTOS = REPO / "protos"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _buf() -> str:
    beside_python = Path(sys.executable).parent / "buf"
    found = str(beside_python) if beside_python.exists() else shutil.which("buf")
    if found is None:
        pytest.fail("buf is not installed: pip install buf-bin (the dev extra has it)")
    return found


def test_buf_lint_passes():
    done = subprocess.run([_buf(), "lint"], cwd=PROTOS, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_buf_yaml_excepts_only_the_contract_names():
    text = (PROTOS / "buf.yaml").read_text()
    excepted = {line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")}
    assert excepted == {"STANDARD", "SERVICE_SUFFIX", "RPC_REQUEST_STANDARD_NAME",
                        "RPC_RESPONSE_STANDARD_NAME", "RPC_REQUEST_RESPONSE_UNIQUE"}


def _generated(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for pattern in GENERATED
            for p in folder.rglob(pattern)}


def test_checked_in_generated_code_is_current(tmp_path):
    # The same command as `make protos`, into a temporary folder.
    protos = (PROTOS / "batchwire" / "v1").glob("*.proto")
    sources = sorted(str(p.relative_to(REPO)) for p in protos)
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *sources],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh, checked_in = _generated(tmp_path), _generated(PROTOS)
    assert sorted(checked_in) == sorted(fresh), "generated files without a .proto, or missing"
    stale = [name for name in fresh if not filecmp.cmp(fresh[name], checked_in[name],
                                                        shallow=False)]
    assert not stale, f"stale generated code, run `make protos`: {stale}"
