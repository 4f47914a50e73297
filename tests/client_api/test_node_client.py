"""A Node.js client built from the .proto files alone (@grpc/grpc-js + @grpc/proto-loader)
streams a completion and gets tool calls, as a Python client gets them."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from batchwire.v1 import generate_pb2

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


def test_node_client_gets_tool_calls(server, node_client):
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"name": "get_weather", "description": "The weather in a city", "parameters": city}]
    prompt = "What is the weather in Paris?"
    done = subprocess.run(["node", str(node_client), server.address, prompt, "20",
                           json.dumps(tools)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (call,) = json.loads(done.stdout)["tool_calls"]
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content=prompt)],
        tools=[generate_pb2.Tool(name="get_weather", description="The weather in a city",
                                 parameters=json.dumps(city))],
        tool_choice=generate_pb2.TOOL_CHOICE_REQUIRED, sampling=greedy(20, ignore_eos=False))
    _, _, last, _ = collect(server.stub.Generate(request, timeout=300))
    (expected,) = last.tool_calls
    assert call["name"] == expected.name == "get_weather"
    assert json.loads(call["arguments"]) == json.loads(expected.arguments)
    assert set(json.loads(call["arguments"])) == {"city"} and call["id"].startswith("call_")
