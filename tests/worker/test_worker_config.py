"""The worker's settings cross a process boundary as command-line options: a scheduler that starts
its own worker group builds a WorkerConfig and passes `to_argv()`; the worker parses them back."""

from __future__ import annotations

import dataclasses

import pytest
from batchwire.common.sizes import byte_size, format_size
from batchwire.common.worker_config import WorkerConfig

from worker_svc.__main__ import build_parser, worker_config


def test_the_argv_round_trip_gives_back_the_same_config():
    config = WorkerConfig(model="/models/x", dtype="float32", device="cpu", block_size=32,
                          kv_cache_memory_bytes=3 << 30, max_num_reqs=7, max_model_len=999,
                          max_num_batched_tokens=1234, max_logprobs=3, seed=42,
                          attention_backend="torch", tensor_parallel_size=2)
    args = build_parser().parse_args(config.to_argv())
    back = worker_config(args, rank=0, init_method=config.distributed_init_method)
    assert back == config
    # Every field but the per-rank ones travels: a new field must be added to to_argv too.
    per_rank = {"rank", "distributed_init_method"}
    flags = {name.removeprefix("--").replace("-", "_")
             for name in config.to_argv() if name.startswith("--")}
    flags = {"kv_cache_memory_bytes" if f == "kv_cache_memory" else f for f in flags}
    assert {f.name for f in dataclasses.fields(WorkerConfig)} - per_rank <= flags


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
