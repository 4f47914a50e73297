"""The README's first example, as a new user runs it: `batchwire generate` with a simple factual
question and no sampling flag answers it, at the defaults the server reports in GetModelInfo."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request

import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import REPO

pytestmark = pytest.mark.slow


def test_the_server_reports_its_sampling_defaults_and_weights(server):
    info = server.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    d = info.sampling_defaults
    # The embedded model ships no generation config: batchwire's choice for it is greedy.
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (
        0.0, 1.0, 0, 0.0, 1.0, 16)
    assert all(d.HasField(f) for f in ("temperature", "top_p", "top_k", "min_p",
                                       "repetition_penalty", "max_tokens"))
    assert "embedded 4-bit SmolLM2-135M-Instruct: greedy" in info.sampling_defaults_source
    assert info.weights == (
        "GGUF, 4-bit Q4_1 (210 of 272 tensors; also F32, Q8_0), de-quantised to float32")
    with urllib.request.urlopen(f"{server.base_url}/models", timeout=30) as reply:
        assert json.load(reply)["data"][0]["weights"] == info.weights  # what the worker said


def readme_first_example() -> tuple[list[str], str, str]:
    """The README's first console block: (the command's arguments, its stdout, its usage line)."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("```console\n") + 11:].split("```", 1)[0].splitlines()
    command = shlex.split(block[0].removeprefix("$ .venv/bin/batchwire "))
    return command, block[1], block[2]


def test_the_readme_first_example_answers_correctly(server):
    command, answer, usage = readme_first_example()
    assert command == ["generate", "What is the capital of France?"]
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", *command, "--address", server.address],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert done.stdout == answer + "\n"
    # Earlier requests in the session may have cached the chat template's system prompt.
    assert re.sub(r"\(\d+ cached\)", "(0 cached)", done.stderr.strip()) == usage
