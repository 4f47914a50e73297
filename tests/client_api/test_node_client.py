"""A Node.js client built from the .proto files alone (@grpc/grpc-js + @grpc/proto-loader)
streams a completion, and gets what a Python client gets."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.client_api.server_process import REPO, collect, greedy, text_request

pytestmark = pytest.mark.slow

NODE_DIR = REPO / "tests" / "node"


@pytest.fixture(scope="module")
def node_client():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js and npm are not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        # The pinned versions of package-lock.json, from the npm registry.
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    return NODE_DIR / "client.js"


def test_node_client_streams_a_completion(server, node_client):
    prompt = "The capital of France is"
    done = subprocess.run(["node", str(node_client), server.address, prompt, "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    ids, text, last, _ = collect(server.stub.Generate(text_request(prompt, greedy(8)),
                                                      timeout=60))
    assert result["token_ids"] == ids and result["text"] == text
    assert result["messages"] > 1, "the reply should stream"
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 8
