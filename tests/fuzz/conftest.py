"""The fuzz tests' worker process: the tiny random Llama on loopback, one torch thread."""

from __future__ import annotations

import os

import pytest
import torch

from tests.services.conftest import LIMITS, WorkerProcess


@pytest.fixture(scope="package")
def fuzz_workers(tmp_path_factory, tiny_llama):
    """(the worker process, an in-process reference Worker on the same settings), loaded side
    by side."""
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.runner.worker import Worker

    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)  # the reference worker in this process too
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the worker process
    worker = WorkerProcess(tiny_llama, tmp_path_factory.mktemp("fuzz-worker"))
    try:
        reference = Worker(WorkerConfig(model=tiny_llama, dtype="float32",
                                        kv_cache_memory_bytes=8 << 20, **LIMITS))
        yield worker.wait_ready(), reference
    finally:
        worker.kill()
    torch.set_num_threads(threads)
    if env is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = env
