"""A bench stopped by SIGTERM stops the server it started (the server runs in a process group of
its own, out of reach of a signal to the bench's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_server_the_bench_started(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-m", "scheduler_svc.cli", "bench", "soak", "--quick", "--threads", "1",
         "--results", str(tmp_path)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (servers := _children(bench.pid)):
            assert bench.poll() is None, "the bench ended before it started a server"
            assert time.monotonic() < deadline, "no server started"
            time.sleep(0.2)
        time.sleep(2)  # loading: the server process is well under way
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(_alive(s) for s in servers):
            assert time.monotonic() < deadline, f"the server outlived the bench: {servers}"
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
