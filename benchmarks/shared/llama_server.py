"""llama.cpp's `llama-server` (built by `make llama-server`) on a free loopback port, the peer of
`batchwire bench latency`: the same GGUF file, served with its own (quantised) weights."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int, context: int,
                 startup_timeout_s: float = 120.0) -> None:
        if not os.access(binary, os.X_OK):
            raise SystemExit(f"--llama-server: {binary} is not an executable file (`make "
                             "llama-server` builds build/llama-server/cmake/bin/llama-server)")
        if not model.endswith(".gguf"):
            raise SystemExit(f"--llama-server needs a GGUF model, and the model is {model}")
        self.log_path = Path(tempfile.mkdtemp(prefix="bw-bench-llama-")) / "llama-server.log"
        # One slot (-np 1): one stream at a time, as batchwire is measured here.
        base = [binary, "-m", model, "--host", "127.0.0.1", "-t", str(threads), "-tb",
                str(threads), "-np", "1", "-c", str(context)]
        # Its defaults first. Where they crash at start (on a CPU with AMX whose tiles the
        # system does not grant, the weights' repacking for AMX segfaults), again without
        # repacking: the fastest llama.cpp that runs here is the peer, and the report says so.
        self.extra_flags: list[str] = []
        for extra in ([], ["--no-repack"]):
            self.extra_flags = extra
            if self._start(base + extra, startup_timeout_s):
                return
        raise RuntimeError("llama-server did not come up; its log:\n"
                           f"{self.log_path.read_text()[-4000:]}")

    def _start(self, cmd: list[str], startup_timeout_s: float) -> bool:
        """True once healthy; False if it died of a signal at start (the caller retries)."""
        port = free_port()
        self.http_url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(cmd + ["--port", str(port)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(time.monotonic() + startup_timeout_s)
            return True
        except RuntimeError:
            crashed = (self.process.returncode or 0) < 0
            self.stop()
            if crashed:
                return False
            raise
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.http_url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not come up; its log:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
