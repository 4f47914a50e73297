"""The llama-server peer of `bench latency`: its defaults first, again without repacking only
where they die of a signal at start (as on a CPU whose AMX tiles the system does not grant)."""

from __future__ import annotations

import stat
import sys

import pytest
from batchwire.benchmarks.shared.llama_server import LlamaServer

# A stand-in binary: dies of SIGSEGV at start with its default flags (as llama-server's AMX
# repacking does on such a CPU); with --no-repack it answers /health on the port it is given.
FAKE = f"""#!{sys.executable}
import http.server, os, signal, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_MODE"] + ".calls", "a") as calls:
    print(" ".join(argv), file=calls)
if "--exit" in open(os.environ["FAKE_MODE"]).read():
    sys.exit(1)
if "--no-repack" not in argv:
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(argv[argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    mode = tmp_path / "mode"
    mode.write_text("")
    monkeypatch.setenv("FAKE_MODE", str(mode))
    return str(binary), mode


def test_a_crash_at_start_is_retried_without_repacking(fake_binary):
    binary, mode = fake_binary
    server = LlamaServer(binary, "model.gguf", 2, 256, startup_timeout_s=30)
    try:
        assert server.extra_flags == ["--no-repack"]
        assert server.process.poll() is None
    finally:
        server.stop()
    calls = (mode.parent / "mode.calls").read_text().splitlines()
    assert len(calls) == 2 and "--no-repack" not in calls[0] and "--no-repack" in calls[1]


def test_an_ordinary_failure_is_reported_not_retried(fake_binary):
    binary, mode = fake_binary
    mode.write_text("--exit")
    with pytest.raises(RuntimeError, match="llama-server did not come up"):
        LlamaServer(binary, "model.gguf", 2, 256, startup_timeout_s=30)
    assert len((mode.parent / "mode.calls").read_text().splitlines()) == 1
