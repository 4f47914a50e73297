"""A Go client built from the .proto files alone (protoc with protoc-gen-go and
protoc-gen-go-grpc, Debian's Go packages, no module download) streams a completion, samples
n = 2 with prompt logprobs, reads an INVALID_ARGUMENT, and gets the tool calls of a chat with a
strict tool (parallel, and with parallel_tool_calls false), as a Python client does.

The Go packages come from apt when missing (CI runs as root with Debian's registry reachable).
Not golang-goprotobuf-dev: on Debian 12 it pulls protoc-gen-go 1.3, which refuses proto3
`optional` fields; protoc-gen-go (APIv2, 1.28) with golang-github-golang-protobuf-1-5-dev
generates them, and grpc-go builds against it. The build runs in GOPATH mode
(GO111MODULE=off, GOPATH = the generated code + /usr/share/gocode, GOPROXY=off): offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import REPO, collect, greedy

pytestmark = pytest.mark.slow

GO_DIR = REPO / "tests" / "go"
GOCODE = Path("/usr/share/gocode/src")
APT_PACKAGES = ("golang-go", "golang-google-grpc-dev", "golang-google-protobuf-dev",
                "golang-github-golang-protobuf-1-5-dev", "protoc-gen-go", "protoc-gen-go-grpc",
                "protobuf-compiler")
PROMPT = "The capital of France is"
MAX_TOKENS = 6


def _toolchain_present() -> bool:
    tools = all(shutil.which(t) for t in ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"))
    sources = all((GOCODE / p).is_dir() for p in ("google.golang.org/grpc",
                                                  "google.golang.org/protobuf"))
    if not (tools and sources):
        return False
    # protoc-gen-go 1.3 has no --version (and no proto3 optional); 1.28 has both.
    done = subprocess.run(["protoc-gen-go", "--version"], capture_output=True, text=True)
    return done.returncode == 0


def _apt_install() -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("the Go toolchain is missing and there is no apt-get to install it")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = subprocess.run([*sudo, "apt-get", "update"], capture_output=True, text=True,
                            timeout=300, env=env)
    failed = [line for line in update.stdout.splitlines() + update.stderr.splitlines()
              if line.startswith(("Err:", "W: Failed", "E: "))]
    if update.returncode != 0 or failed:
        pytest.skip("the Go toolchain is missing and apt cannot reach its registry: "
                    + "; ".join(failed or [update.stderr.strip()[-300:]]))
    done = subprocess.run([*sudo, "apt-get", "install", "-y", "--no-install-recommends",
                           *APT_PACKAGES], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"apt-get install failed:\n{done.stdout[-3000:]}\n{done.stderr}"


@pytest.fixture(scope="module")
def go_client(tmp_path_factory) -> Path:
    if not _toolchain_present():
        _apt_install()
        assert _toolchain_present(), "apt installed the packages but the Go toolchain is incomplete"
    root = tmp_path_factory.mktemp("go")
    src = root / "src"
    (src / "batchwire" / "v1").mkdir(parents=True)
    (src / "client").mkdir()
    shutil.copy(GO_DIR / "main.go", src / "client" / "main.go")
    # The .proto has no go_package option: the import path is given here instead.
    mapping = "Mbatchwire/v1/generate.proto=batchwire/v1"
    subprocess.run(["protoc", f"-I{REPO / 'protos'}",
                    f"--go_out={src}", f"--go_opt=paths=source_relative,{mapping}",
                    f"--go-grpc_out={src}", f"--go-grpc_opt=paths=source_relative,{mapping}",
                    str(REPO / "protos" / "batchwire" / "v1" / "generate.proto")],
                   check=True, capture_output=True, text=True, timeout=120)
    env = {**os.environ, "GOPATH": f"{root}:{GOCODE.parent}", "GO111MODULE": "off",
           "GOPROXY": "off", "GOFLAGS": "", "GOCACHE": str(root / "cache")}
    binary = root / "client-bin"
    done = subprocess.run(["go", "build", "-o", str(binary), "."], cwd=src / "client", env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"go build failed:\n{done.stderr}"
    return binary


def test_go_client_streams_samples_n_and_reads_a_status(server, go_client):
    done = subprocess.run([str(go_client), server.address, PROMPT, str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)

    ids, text, last, _ = collect(server.stub.Generate(generate_pb2.GenerateRequest(
        text=PROMPT, sampling=greedy(MAX_TOKENS)), timeout=60))
    one = result["completion"]
    assert one["token_ids"] == ids and one["text"] == text
    assert one["messages"] > 1, "the reply should stream"
    assert one["finish_reason"] == "length" and one["completion_tokens"] == MAX_TOKENS

    # n = 2, greedy: both sequences are the single request's output; prompt logprobs once.
    two = result["parallel"]
    assert two["token_ids"] == {"0": ids, "1": ids}
    assert two["finish_reasons"] == {"0": "length", "1": "length"}
    assert (two["prompt_tokens"], two["completion_tokens"]) == (last.usage.prompt_tokens,
                                                                2 * MAX_TOKENS)
    messages = list(server.stub.Generate(generate_pb2.GenerateRequest(
        text=PROMPT, sampling=greedy(MAX_TOKENS, prompt_logprobs=0)), timeout=60))
    expected = list(messages[0].prompt_logprobs)
    assert len(expected) == last.usage.prompt_tokens - 1
    assert two["prompt_logprob_token_ids"] == [lp.token_id for lp in expected]
    assert two["prompt_logprobs"] == pytest.approx([lp.logprob for lp in expected], abs=1e-3)

    refusal = result["refusal"]
    assert refusal["code"] == "InvalidArgument"
    assert refusal["message"].startswith("sampling.n: 0"), refusal

    # What test_openai_strict_tools.py checks in Python, the same request from Go.
    for name, cities in (("parallel", ["Paris", "London"]), ("single", ["Paris"])):
        reply = result["tools"][name]
        assert reply["finish_reason"] == "stop", reply  # Generate's reason: the text ended
        assert [(c["name"], json.loads(c["arguments"])) for c in reply["calls"]] == [
            ("get_weather", {"city": city}) for city in cities], reply
        assert all(c["id"].startswith("call_") for c in reply["calls"])
    server.wait_idle()
