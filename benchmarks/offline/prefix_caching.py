"""Prefix caching on vs off, in the same run on one in-process worker.

1. 32 requests sharing a 512-token prefix (plus 32 tokens of their own), 32 output tokens each:
   median time to first token and total time.
2. A workload with no shared prefix (the first 32 W64 prompts, 32 output tokens each): total
   time, where caching can only cost (hashing, bookkeeping); the aim is under 2%.

    .venv/bin/python -m batchwire.benchmarks.offline.prefix_caching --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.workloads import shared_prefix, w64

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.executors.uni import UniProcExecutor


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """All requests added at t=0, then EngineCore.step()'s calls, timed apart: median time to
    first token, total wall time, process CPU time, and the scheduler's own CPU time (thread
    time, which other processes on a shared machine cannot inflate)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sched, ex = engine.scheduler, engine.executor
    t0, cpu0, sched_cpu = time.perf_counter(), time.process_time(), 0.0
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    first: dict[str, float] = {}
    while sched.has_requests():
        c0 = time.thread_time()
        so = sched.schedule()
        c1 = time.thread_time()
        out = ex.execute_model(so, non_block=True).result()
        if out is None:
            out = ex.sample_tokens(sched.get_grammar_bitmask(so))
        c2 = time.thread_time()
        outputs = sched.update_from_output(so, out)
        sched_cpu += (c1 - c0) + (time.thread_time() - c2)
        for o in outputs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
    return {"ttft": statistics.median(first.values()), "total": time.perf_counter() - t0,
            "cpu": time.process_time() - cpu0, "sched_cpu": sched_cpu}


def compare(shared: list[list[int]], distinct: list[list[int]], max_tokens: int, repeats: int,
            dtype: str, model: str | None = None, on_run=None) -> dict:
    """{(workload, caching on): [run(...) of each repeat]}, on one model, the four cases taking
    turns in every repeat; on_run() is called after each run (a progress bar's update)."""
    longest = max(len(p) for p in shared + distinct) + max_tokens
    configs = {on: SchedulerConfig(model=model, dtype=dtype, max_num_seqs=64,
                                   max_model_len=longest, max_num_batched_tokens=2048,
                                   enable_prefix_caching=on) for on in (True, False)}
    from worker_svc.runner.worker import Worker

    worker = Worker(configs[True].worker_config())  # one model, both engines

    def engine(on: bool) -> EngineCore:
        worker.reset()
        return EngineCore(configs[on], UniProcExecutor(configs[on], worker))

    run(engine(True), shared[:2], 2)  # warm-up
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for _ in range(repeats):
        for on in (True, False):  # interleaved, so drifting machine load hits both alike
            for work, prompts in (("shared", shared), ("distinct", distinct)):
                results.setdefault((work, on), []).append(run(engine(on), prompts, max_tokens))
                if on_run is not None:
                    on_run()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    shared = [p for p, _ in shared_prefix(32, 512, 32, 32)]
    distinct = [p for p, _ in w64()][:32]  # as many requests as the shared workload
    results = compare(shared, distinct, 32, args.repeats, args.dtype)

    def med(key, field):
        return statistics.median(r[field] for r in results[key])

    print(f"prefix caching, dtype {args.dtype}, median of {args.repeats}")
    for work in ("shared", "distinct"):
        for on in (True, False):
            k = (work, on)
            print(f"  {work:8s} cache {'on ' if on else 'off'}  TTFT {med(k, 'ttft'):7.3f} s"
                  f"   total {med(k, 'total'):7.3f} s   CPU {med(k, 'cpu'):7.2f} s"
                  f"   scheduler CPU {1e3 * med(k, 'sched_cpu'):7.1f} ms")
    ttft = med(("shared", False), "ttft") / med(("shared", True), "ttft")
    total = med(("shared", False), "total") / med(("shared", True), "total")
    print(f"  shared 512-token prefix: TTFT {ttft:.2f}x faster, total {total:.2f}x faster")
    # With no shared prefix both runs send the worker the same steps; only the scheduler's
    # hashing and bookkeeping differ, so its CPU time is the cost, measured against the whole.
    extra = med(("distinct", True), "sched_cpu") - med(("distinct", False), "sched_cpu")
    share = extra / med(("distinct", False), "cpu")
    wall = med(("distinct", True), "total") / med(("distinct", False), "total") - 1
    print(f"  no shared prefix: caching adds {1e3 * extra:.1f} ms of scheduler CPU, "
          f"{100 * share:+.2f}% of the run's CPU time (wall time {100 * wall:+.1f}%, "
          "noisy on a shared machine)")


if __name__ == "__main__":
    main()
