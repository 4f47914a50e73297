"""What `batchwire --help` and the client commands promise a new user: every flag explained,
one flag per sampling field, sizes in units, flags that cannot work together refused. A fake
server records what the CLI sends (no model is loaded here)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from batchwire.common.worker_config import WorkerConfig
from batchwire.v1 import generate_pb2, generate_pb2_grpc

from scheduler_svc.cli import build_parser, main
from scheduler_svc.config import SchedulerConfig
from tests.client_api.server_process import REPO

CLI = [sys.executable, "-m", "scheduler_svc.cli"]


class _Recording(generate_pb2_grpc.GenerationServicer):
    """Answers every request with "Paris" cut at max_tokens, and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        last = generate_pb2.GenerateResponse(text="Paris", token_ids=[1], finish_reason="length")
        last.usage.completion_tokens = 16
        yield last

    def GetModelInfo(self, request, context):
        return generate_pb2.GetModelInfoResponse(model_name="fake", has_chat_template=True)


@pytest.fixture
def recording_server():
    servicer = _Recording()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", ["serve", "scheduler", "generate", "chat"])
def test_every_flag_has_a_help_text(command):
    for action in _subparser(command)._actions:
        assert action.help, f"batchwire {command}: --help does not explain {action.option_strings}"


def test_help_texts_show_sizes_in_units_and_no_internal_references(capsys):
    for command in ("serve", "scheduler", "generate", "chat", "worker", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert f"usage: batchwire {command}" in out
        assert not re.search(r"issue \d", out) and "python -m worker_svc" not in out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "default: 1G]" in out and "default: 16M]" in out and "1073741824" not in out
    assert "default: None" not in out and "[BATCHWIRE_MODEL]" in out


def test_bench_help_lists_each_benchmark_once(capsys):
    from batchwire.benchmarks.__main__ import BENCHMARKS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in [*BENCHMARKS, "all"]:
        # argparse indents each sub-command by 4; a wrapped description line by more.
        listed = re.findall(rf"^ {{4}}{re.escape(name)}(\s|$)", out, re.M)
        assert len(listed) == 1, (name, out)


def test_drain_timeout_waits_less_for_a_person_at_a_terminal(monkeypatch):
    import io
    import os

    from scheduler_svc.cli.commands import DRAIN_S, INTERACTIVE_DRAIN_S, _drain_timeout

    monkeypatch.setattr(sys, "stdin", io.StringIO())  # a container's or a service's stdin
    assert _drain_timeout(None) == DRAIN_S == 600
    assert _drain_timeout(12.0) == 12.0  # given: it wins
    controller, terminal = os.openpty()
    with os.fdopen(controller), os.fdopen(terminal) as tty:
        monkeypatch.setattr(sys, "stdin", tty)
        assert _drain_timeout(None) == INTERACTIVE_DRAIN_S == 30
        assert _drain_timeout(12.0) == 12.0


def test_version():
    done = subprocess.run([*CLI, "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("batchwire ")


def test_system_without_the_chat_template_is_refused():
    done = subprocess.run([*CLI, "generate", "--raw", "--system", "Be brief.", "Hi"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "batchwire generate: --system needs the chat template, which --raw turns off"]


def test_every_sampling_field_has_a_flag(recording_server):
    servicer, address = recording_server
    done = subprocess.run(
        [*CLI, "generate", "--address", address, "--raw", "--max-tokens", "7",
         "--min-tokens", "2", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5",
         "--min-p", "0.1", "--seed", "3", "--stop", "x", "--stop-token-id", "9",
         "--ignore-eos", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
         "--frequency-penalty", "0.3", "--logprobs", "2", "--regex", "[a-z]+", "-"],
        cwd=REPO, capture_output=True, text=True, timeout=60, input="The capital?\n")
    assert done.returncode == 0, done.stderr
    request = servicer.requests[-1]
    assert request.text == "The capital?"  # stdin's trailing newline is not the prompt's
    s = request.sampling
    assert (s.max_tokens, s.min_tokens, s.top_k, s.seed, s.logprobs) == (7, 2, 5, 3, 2)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.1)
    assert s.presence_penalty == pytest.approx(0.2)
    assert s.frequency_penalty == pytest.approx(0.3)
    assert list(s.stop) == ["x"] and list(s.stop_token_ids) == [9] and s.ignore_eos
    assert s.regex == "[a-z]+"


def test_unset_flags_leave_the_fields_unset(recording_server):
    servicer, address = recording_server
    done = subprocess.run([*CLI, "generate", "--address", address, "Hi"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    request = servicer.requests[-1]
    # The model has a chat template: the prompt goes through it, as a user message.
    assert [(m.role, m.content) for m in request.messages] == [("user", "Hi")]
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not request.sampling.HasField(field), field  # the server's default applies


def test_chat_says_when_a_reply_was_cut(recording_server):
    servicer, address = recording_server
    done = subprocess.run([*CLI, "chat", "--address", address], cwd=REPO, capture_output=True,
                          text=True, timeout=60, input="What is the capital of France?\n")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "[cut at max_tokens, after 16 tokens: --max-tokens raises the limit]" in done.stderr
    assert [m.role for m in servicer.requests[-1].messages] == ["user"]


def test_scheduler_and_worker_agree_on_the_step_budget():
    assert SchedulerConfig().max_num_batched_tokens == WorkerConfig().max_num_batched_tokens
