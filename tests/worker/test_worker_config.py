"""The worker's settings cross a process boundary as command-line options: a scheduler that starts
its own worker group builds a WorkerConfig and passes `to_argv()`; the worker parses them back."""

from __future__ import annotations

import dataclasses

import pytest
from batchwire.common.sizes import byte_size, format_size
from batchwire.common.worker_config import WorkerConfig

from worker_svc.server.options import build_parser, worker_config


def test_the_argv_round_trip_gives_back_the_same_config():
    config = WorkerConfig(model="/models/x", dtype="float32", device="cpu", block_size=32,
                          kv_cache_memory_bytes=3 << 30, max_num_reqs=7, max_model_len=999,
                          max_num_batched_tokens=1234, max_logprobs=3, seed=42,
                          attention_backend="torch", tensor_parallel_size=2,
                          batch_invariant=True)
    args = build_parser().parse_args(config.to_argv())
    back = worker_config(args, rank=0, init_method=config.distributed_init_method)
    assert back == config
    # Every field but the per-rank ones travels: a new field must be added to to_argv too.
    per_rank = {"rank", "distributed_init_method"}
    options = {name.removeprefix("--").replace("-", "_") for name in config.to_argv()
               if name.startswith("--")}
    options = {"kv_cache_memory_bytes" if o == "kv_cache_memory" else o for o in options}
    assert {f.name for f in dataclasses.fields(WorkerConfig)} - per_rank <= options


@pytest.mark.parametrize("text, size", [
    ("4096", 4096), ("512M", 512 << 20), ("512MiB", 512 << 20), ("1G", 1 << 30),
    ("1gb", 1 << 30), ("1T", 1 << 40), ("1.5K", 1536),
])
def test_one_size_parser_for_every_command(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "1X"])
def test_bad_sizes_are_refused_naming_the_text(text):
    with pytest.raises(ValueError, match="size"):
        byte_size(text)


def test_sizes_print_in_their_shortest_exact_form():
    assert [format_size(n) for n in (1 << 30, 512 << 20, 1536, 1 << 40)] == [
        "1G", "512M", "1536", "1T"]


def test_options_come_from_batchwire_variables_and_a_flag_wins(monkeypatch):
    for name, value in {"BATCHWIRE_PORT": "50099", "BATCHWIRE_KV_CACHE_MEMORY": "2G",
                        "BATCHWIRE_BLOCK_SIZE": "32", "BATCHWIRE_NORMALIZE": "off",
                        "BATCHWIRE_NO_ZMQ": "yes", "BATCHWIRE_RANK": "1",
                        "BATCHWIRE_SCHEDULER_TLS_CA": "/ca.pem"}.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([])
    assert (args.port, args.kv_cache_memory, args.block_size, args.rank) == (50099, 2 << 30, 32, 1)
    assert (args.normalize, args.no_zmq, args.scheduler_tls_ca) == (False, True, "/ca.pem")
    args = build_parser().parse_args(["--port", "7", "--normalize", "--block-size", "8"])
    assert (args.port, args.normalize, args.block_size) == (7, True, 8)


def test_a_bad_variable_is_refused_naming_its_option(monkeypatch, capsys):
    monkeypatch.setenv("BATCHWIRE_MAX_NUM_REQS", "many")
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert "argument --max-num-reqs: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("value, on", [("1", True), ("TRUE", True), ("On", True), ("0", False),
                                       ("no", False), ("", False), ("maybe", False)])
def test_the_worker_and_the_scheduler_read_a_yes_no_variable_alike(monkeypatch, value, on):
    from scheduler_svc.cli.commands import build_parser as scheduler_parser

    monkeypatch.setenv("BATCHWIRE_NORMALIZE", value)
    assert build_parser().parse_args([]).normalize is on
    assert scheduler_parser().parse_args(["serve"]).normalize is on


@pytest.mark.parametrize(("settings", "words"), [
    (dict(max_loras=2, tensor_parallel_size=2), "without tensor parallelism"),
    (dict(max_loras=2, batch_invariant=True), "not served in batch-invariant mode"),
    (dict(max_loras=-1), "max_loras must be at least 0"),
    (dict(max_lora_rank=0), "max_lora_rank must be at least 1"),
])
def test_lora_settings_that_cannot_work_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        WorkerConfig(**settings)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_lora_with_tensor_parallelism_is_refused_at_start_naming_the_options(command):
    """Before any port is bound, model loaded or rank started: one line, not a traceback."""
    from scheduler_svc.cli import main

    with pytest.raises(SystemExit) as refused:
        main([command, "--tensor-parallel-size", "2", "--max-loras", "2"])
    message = str(refused.value.code)
    assert message.startswith(f"batchwire {command}: max_loras=2 (--max-loras)")
    assert "tensor_parallel_size=2 (--tensor-parallel-size)" in message
