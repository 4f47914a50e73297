"""Prefix caching on vs off, in the same run on one in-process worker.

1. 32 requests sharing a 512-token prefix (plus 32 tokens of their own), 32 output tokens each:
   median time to first token and total time.
2. A workload with no shared prefix (the first 32 W64 prompts, 32 output tokens each): total
   time, where caching can only cost (hashing, bookkeeping); the aim is under 2%.

    .venv/bin/python -m benchmarks.prefix_caching --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.offline_w64 import w64
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.executor import UniProcExecutor
from scheduler_svc.sampling_params import SamplingParams


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(median time to first token, total time) in seconds, all requests added at t=0."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, client_id=str(i))
    first: dict[str, float] = {}
    while engine.has_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    return statistics.median(first.values()), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(512)]
    shared = [prefix + [rng.randrange(100, 49000) for _ in range(32)] for _ in range(32)]
    distinct = [p for p, _ in w64()][:32]  # as many requests as the shared workload

    base = dict(dtype=args.dtype, max_num_seqs=64, max_model_len=640, max_num_batched_tokens=2048)
    configs = {on: SchedulerConfig(enable_prefix_caching=on, **base) for on in (True, False)}
    from worker_svc.worker import Worker

    worker = Worker(configs[True].worker_config())  # one model, both engines

    def engine(on: bool) -> EngineCore:
        worker.reset()
        return EngineCore(configs[on], UniProcExecutor(configs[on], worker))

    run(engine(True), shared[:2], 2)  # warm-up
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for on in (True, False):  # interleaved, so drifting machine load hits both alike
            results.setdefault(("shared", on), []).append(run(engine(on), shared, 32))
            results.setdefault(("distinct", on), []).append(run(engine(on), distinct, 32))

    def med(key, i):
        return statistics.median(r[i] for r in results[key])

    print(f"prefix caching, dtype {args.dtype}, median of {args.repeats}")
    for work in ("shared", "distinct"):
        for on in (True, False):
            print(f"  {work:8s} cache {'on ' if on else 'off'}  TTFT {med((work, on), 0):7.3f} s"
                  f"   total {med((work, on), 1):7.3f} s")
    ttft = med(("shared", False), 0) / med(("shared", True), 0)
    total = med(("shared", False), 1) / med(("shared", True), 1)
    print(f"  shared 512-token prefix: TTFT {ttft:.2f}x faster, total {total:.2f}x faster")
    cost = med(("distinct", True), 1) / med(("distinct", False), 1) - 1
    print(f"  no shared prefix: caching costs {100 * cost:+.1f}% total time")


if __name__ == "__main__":
    main()
