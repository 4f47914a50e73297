"""`batchwire bench hostile-http --quick`: the hostile table against a server it starts (the tiny
model), beside a greedy stream. What must hold on any machine: no 5xx, every 4xx of the
application an OpenAI error object, every application case answered, the server alive and its
greedy stream's text unchanged. The gap and RSS figures are reported, not asserted: they
measure this loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_hostile_table_quick(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scheduler_svc.cli", "bench", "hostile-http", "--quick",
           "--threads", "1", "--results", str(tmp_path)]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as e:
        tail = [(x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-2000:]
                for x in (e.stdout, e.stderr)]
        pytest.fail("bench hostile-http --quick ran past 400 s:\n" + "\n".join(tail))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "hostile-http.json").read_text())
    cases = result["cases"]
    assert len(cases) >= 100
    assert not [c for c in cases if c["status"] >= 500]
    app = [c for c in cases if not c["http_layer"]]
    assert all(400 <= c["status"] < 500 and c["error_object"] for c in app), [
        c for c in app if not (400 <= c["status"] < 500 and c["error_object"])]
    by_name = {c["case"]: c for c in cases}
    assert by_name["50 MB of token ids to completions"]["status"] == 413
    assert by_name["5 M characters to /tokenize"]["status"] == 413
    assert by_name["completions priority=2**80"]["status"] == 400
    assert by_name["completions max_tokens \"10\""]["status"] == 400
    # uvicorn answers malformed HTTP itself, in plain text: a 400 or a closed connection.
    assert all(c["status"] in (0, 400) for c in cases if c["http_layer"])
    assert result["alive"] and result["greedy_unchanged"] and result["busy_streams"] >= 1
    assert result["idle_gap_s"] > 0 and result["busy_gap_s"] > 0
