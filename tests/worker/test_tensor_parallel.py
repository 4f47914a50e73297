"""TP=2 on CPU (gloo): two ranks driven with the same steps give TP=1's greedy tokens."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import StepDriver, greedy

PROMPTS = {"a": [5, 17, 29, 41, 53, 65, 77], "b": list(range(100, 137)), "c": [300, 2, 9]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(model, rank, size, init_method, max_tokens, results):
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.runner.worker import Worker

    worker = Worker(WorkerConfig(
        model=model, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_reqs=8,
        max_model_len=256, max_num_batched_tokens=256, tensor_parallel_size=size, rank=rank,
        distributed_init_method=init_method,
    ))  # fmt: skip
    # Every rank gets every step; rank 0's answer is the one that counts.
    out = drive(worker, max_tokens)
    results.put((rank, worker.num_blocks, worker.get_info().tensor_parallel_size, out))
    # Leave the group together (see test_pipeline_parallel.run_rank).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def drive(worker, max_tokens: int) -> dict[str, list[int]]:
    """The prompts' greedy tokens (EOS masked until max_tokens), 16 prompt tokens a step."""
    sampling = greedy()
    sampling.min_tokens = max_tokens
    sampling.stop_token_ids.append(2)
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=16)
    for r, p in PROMPTS.items():
        driver.add(r, p, max_tokens, sampling)
    return driver.run()


def generate(model, size, max_tokens):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=run_rank, args=(model, r, size, init, max_tokens, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


def single_worker(request, tiny_checkpoints, which: str):
    """TP=1 in this process (no group to join, so no process of its own): the tiny Llama on the
    ranks' settings, or the session's default-model worker rather than a second load of it."""
    if which == "tiny":
        return tiny_worker(tiny_checkpoints["llama"], kv_cache_memory_bytes=16 << 20,
                           max_num_reqs=8, max_model_len=256, max_num_batched_tokens=256)
    worker = request.getfixturevalue("default_worker")
    worker.reset()
    return worker


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_tp2_matches_tp1(request, tiny_checkpoints, which):
    model = tiny_checkpoints["llama"] if which == "tiny" else None
    max_tokens = 12
    single = drive(single_worker(request, tiny_checkpoints, which), max_tokens)
    ranks = generate(model, 2, max_tokens)
    assert [r[0] for r in ranks] == [0, 1]
    assert ranks[0][1] == ranks[1][1], "ranks disagree on the number of KV blocks"
    assert ranks[0][2] == 2
    # Both ranks sampled the same tokens (they gathered the same logits), equal to TP=1's.
    assert ranks[0][3] == ranks[1][3]
    for r in PROMPTS:
        # Exact: an all-reduce sums in another order than one matmul, which could flip a near-tie,
        # but these prompts have none on either model.
        assert ranks[0][3][r] == single[r], f"{r}: TP=2 differs from TP=1"
