"""Pipeline parallelism: W64 (or its first N requests) on PP=1 against PP=2, both over ZMQ from
the offline API, in the same run; useful output tokens/s and each stage's idle share.

A stage's busy time is its process's CPU time over the run (each rank runs one torch thread, so
a busy rank uses one core); idle = 1 - busy / wall. With one batch in flight the stages take
turns, so each should idle about (P - 1) / P of the time plus the scheduler's share.

    OMP_NUM_THREADS=1 .venv/bin/python -m batchwire.benchmarks.offline.pipeline \
        --num-requests 16 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.workloads import w64


def rank_processes(llm) -> list[psutil.Process]:
    """The group's rank processes in rank order (a one-rank group is the launched process)."""
    launched = psutil.Process(llm.engine.executor.group.process.pid)
    children = launched.children(recursive=True)
    return sorted(children, key=lambda p: p.create_time()) if children else [launched]


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def run(pp: int, workload, dtype: str, repeats: int) -> tuple[float, list[float]]:
    from scheduler_svc import LLM, SamplingParams

    llm = LLM(dtype=dtype, pipeline_parallel_size=pp, executor_backend="zmq", max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=512 << 20, max_model_len=512)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    ranks = rank_processes(llm)
    rates, idles = [], []
    try:
        for _ in range(repeats):
            before = [cpu_seconds(p) for p in ranks]
            t0 = time.perf_counter()
            outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            busy = [cpu_seconds(p) - b for p, b in zip(ranks, before, strict=True)]
            rates.append(sum(len(o.token_ids) for o in outputs) / wall)
            idles.append([1 - b / wall for b in busy])
    finally:
        llm.shutdown()
    median = statistics.median(rates)
    return median, idles[rates.index(median)] if median in rates else idles[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the ranks
    workload = w64(n=args.num_requests)
    results = {pp: run(pp, workload, args.dtype, args.repeats) for pp in (1, 2)}
    print(f"W64 first {args.num_requests} requests, dtype {args.dtype}, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    for pp, (rate, idle) in results.items():
        stages = ", ".join(f"stage {i} idle {x:.0%}" for i, x in enumerate(idle))
        print(f"PP={pp}: {rate:6.1f} useful output tok/s ({rate / results[1][0]:.2f}x PP=1); "
              f"{stages}")


if __name__ == "__main__":
    main()
