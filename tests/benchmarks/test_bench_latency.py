"""`batchwire bench latency --quick` runs one stream at a time through a real `batchwire serve`
and reports TTFT and TPOT per case. (Without llama-server: the peer is a binary built by
`make llama-server`.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_latency_quick_reports_each_case(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scheduler_svc.cli", "bench", "latency", "--quick", "--threads",
           "1", "--results", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "latency.json").read_text())
    assert data["benchmark"] == "latency" and data["quick"] is True and "ratios" not in data
    summary = data["summary"]
    assert list(summary) == ["batchwire"]  # no llama-server given
    assert list(summary["batchwire"]) == ["ttft 32", "out 4", "out 8"]
    for case, m in summary["batchwire"].items():
        assert m["runs"] == 2 and m["ttft_ms"] > 0, case
        assert (m["tpot_ms"] is None) == (case == "ttft 32"), case
    assert summary["batchwire"]["out 8"]["output_tokens"] == 8
    assert len(data["load_averages"]) == 2
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
