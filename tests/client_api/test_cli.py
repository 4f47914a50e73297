"""The batchwire command: help for every sub-command, and `generate` streaming from a server."""

from __future__ import annotations

import subprocess
import sys

import pytest
from batchwire.common.sizes import byte_size

from scheduler_svc.cli import build_parser, main
from tests.client_api.server_process import REPO, collect, greedy, text_request


def test_every_option_is_explained(capsys):
    for command in ("serve", "scheduler", "generate", "chat"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "usage: batchwire " + command in out
    for action in build_parser()._subparsers._group_actions[0].choices["serve"]._actions:
        assert action.help, f"--help does not explain {action.option_strings}"


def test_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("BATCHWIRE_PORT", "6000")
    monkeypatch.setenv("BATCHWIRE_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("BATCHWIRE_KV_CACHE_MEMORY", "512M")
    args = build_parser().parse_args(["serve"])
    assert args.port == 6000 and args.no_prefix_caching and args.kv_cache_memory == 512 << 20
    assert build_parser().parse_args(["serve", "--port", "7000"]).port == 7000


def test_byte_sizes():
    assert byte_size("1G") == byte_size("1GiB") == 1 << 30
    assert byte_size("512m") == 512 << 20 and byte_size("4096") == 4096


@pytest.mark.slow
def test_generate_streams_to_the_terminal(server):
    prompt = "The capital of France is"
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", "generate", "--address", server.address,
         "--temperature", "0", "--max-tokens", "8", "--ignore-eos", prompt],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _, text, _, _ = collect(server.stub.Generate(text_request(prompt, greedy(8)), timeout=60))
    assert done.stdout == text + "\n"
    assert "[length: 5 prompt tokens" in done.stderr


@pytest.mark.slow
def test_generate_reports_a_refusal_as_a_status(server):
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", "generate", "--address", server.address,
         "--max-tokens", "0", "Hi"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "INVALID_ARGUMENT: sampling.max_tokens" in done.stderr


def test_worker_delegates_to_the_worker_service(capsys):
    with pytest.raises(SystemExit) as e:
        main(["worker", "--help"])
    assert e.value.code == 0
    assert "--tensor-parallel-size" in capsys.readouterr().out
