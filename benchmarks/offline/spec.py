"""`batchwire bench spec`: speculative decoding with n-gram drafts, off against K = 2, 4, 8, on
one in-process worker, in the same run.

Prompts that repeat themselves (a list to copy, a function written twice, counting), greedy,
128 output tokens each: one stream at a time and four concurrent streams; tokens/s, time per
output token and the acceptance rate. W64 (random ids: the proposer rarely finds anything
worth proposing), on against off: what speculation costs when it has nothing to offer. And the
scheduler's CPU per step with and without proposals at 64 and 256 decoding requests.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from batchwire.benchmarks.shared.workloads import w64
from tqdm import tqdm

REPEATING = [
    "Copy the list exactly.\nList: red, green, blue, yellow, purple, orange, white, black\n"
    "Copy: red, green,",
    "def area(width, height):\n    result = width * height\n    print(result)\n    return result"
    "\n\n\ndef area(width, height):\n    result = width * height\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15.\nAgain: 1, 2, 3,",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ks", default="2,4,8", help="numbers of speculative tokens to compare")
    p.add_argument("--w64-requests", type=int, default=64)
    p.add_argument("--w64-k", type=int, default=4, help="K of the W64 comparison")
    p.add_argument("--step-sizes", default="64,256", help="decoding requests of the scheduler "
                   "CPU measurement")
    p.add_argument("--step-seq-len", type=int, default=1024, help="their tokens each")


def quick(args: argparse.Namespace) -> None:
    args.output_len, args.ks, args.w64_requests = 8, "2", 8
    args.step_sizes, args.step_seq_len = "16", 128


def run(args: argparse.Namespace) -> None:
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.tokenizer import load_tokenizer
    from worker_svc.runner.worker import Worker

    ks = [int(k) for k in args.ks.split(",") if k]
    # Prefix caching off: a repeat would reuse the last one's prefill. A small pool for the
    # tiny model, whose 1 GiB of blocks would take a second to list for every engine.
    base = SchedulerConfig(model=args.model, dtype=args.dtype, max_num_seqs=64,
                           max_model_len=512, enable_prefix_caching=False,
                           kv_cache_memory_bytes=(16 << 20) if args.quick else (1 << 30))
    worker = Worker(base.worker_config())  # one model for every configuration
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer(p).input_ids for p in REPEATING]
    workload = w64(n=args.w64_requests)
    configs = {"off": None, **{f"K={k}": k for k in ks}}

    def engine(k: int | None) -> Any:
        from scheduler_svc.engine.engine_core import EngineCore
        from scheduler_svc.executors.uni import UniProcExecutor

        config = base if k is None else SchedulerConfig(
            **{**_fields(base), "speculative_method": "ngram", "num_speculative_tokens": k})
        worker.reset()
        return EngineCore(config, UniProcExecutor(config, worker), tokenizer)

    _generate(engine(ks[0]), prompts[:1], 4)  # warm-up: first-call allocations
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    w64_runs: dict[str, list[float]] = {}
    total = args.repeats * (2 * len(configs) + 2)
    with tqdm(total=total, desc="spec", unit="run", disable=None) as bar:
        for _ in range(args.repeats):  # every configuration once per repeat: drift hits all
            for name, k in configs.items():
                singles = [_generate(engine(k), [p], args.output_len) for p in prompts]
                rows.setdefault(("1 stream", name), []).append(_merge_sequential(singles))
                bar.update(1)
                rows.setdefault(("4 streams", name), []).append(
                    _generate(engine(k), prompts[:4], args.output_len))
                bar.update(1)
            for name, k in (("off", None), (f"K={args.w64_k}", args.w64_k)):
                w64_runs.setdefault(name, []).append(_w64(engine(k), workload))
                bar.update(1)
    results = {f"{streams}, {name}": {f: spread([r[f] for r in runs])
                                      for f in ("tok_s", "tpot_ms", "acceptance")}
               for (streams, name), runs in rows.items()}
    w64_results = {name: spread(runs) for name, runs in w64_runs.items()}
    step_cost = scheduler_step_cost(args.w64_k, [int(n) for n in args.step_sizes.split(",")],
                                    args.step_seq_len, 3 if args.quick else 20)

    report = Report("spec", machine_info(args.dtype), vars(args))
    report.table(f"repeating prompts, greedy, {args.output_len} output tokens each; median "
                 f"[min-max] of {args.repeats} runs",
                 ["streams, speculation", "tokens/s", "ms per output token", "acceptance"],
                 [[k, fmt(r["tok_s"]), fmt(r["tpot_ms"]), fmt(r["acceptance"], 2)]
                  for k, r in results.items()])
    report.table(f"W64 ({args.w64_requests} requests), useful output tokens/s",
                 ["speculation", "tokens/s"], [[k, fmt(v)] for k, v in w64_results.items()])
    report.table(f"scheduler CPU per decode step (schedule + update, fake outputs), "
                 f"{args.step_seq_len}-token sequences",
                 ["requests, sequences", "off ms", f"K={args.w64_k} ms"],
                 [[k, f"{v['off']:.2f}", f"{v['on']:.2f}"] for k, v in step_cost.items()])

    def ratio(streams: str, name: str) -> float:
        return (results[f"{streams}, {name}"]["tok_s"]["median"]
                / results[f"{streams}, off"]["tok_s"]["median"])

    ratios = {f"{s}: tokens/s, {n} / off": ratio(s, n)
              for s in ("1 stream", "4 streams") for n in configs if n != "off"}
    ratios[f"W64: tokens/s, K={args.w64_k} / off"] = (
        w64_results[f"K={args.w64_k}"]["median"] / w64_results["off"]["median"])
    report.ratios("same-run ratios (medians; above 1: speculation is faster)", ratios)
    report.data.update(results=results, w64=w64_results, scheduler_step_ms=step_cost)
    report.save(args.results, lambda fig: _draw(fig, results))


def _fields(config: Any) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def _generate(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Runs the prompts together: tokens/s, ms per output token of a stream, acceptance."""
    from scheduler_svc import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    t0 = time.perf_counter()
    num_tokens = 0
    while engine.has_requests():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    assert num_tokens == output_len * len(prompts)
    stats = engine.scheduler.stats
    return {"tok_s": num_tokens / elapsed, "tpot_ms": 1e3 * elapsed / output_len,
            "acceptance": stats.acceptance_rate, "seconds": elapsed,
            "drafted": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens}


def _merge_sequential(runs: list[dict[str, float]]) -> dict[str, float]:
    """One stream after another: the sums of their times and tokens."""
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["tok_s"] * r["seconds"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    return {"tok_s": tokens / seconds, "tpot_ms": 1e3 * seconds / tokens,
            "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else 0.0}


def _w64(engine: Any, workload: list[tuple[list[int], int]]) -> float:
    from scheduler_svc import SamplingParams

    for i, (p, n) in enumerate(workload):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           request_id=str(i))
    t0 = time.perf_counter()
    while engine.has_requests():
        engine.step()
    return sum(n for _, n in workload) / (time.perf_counter() - t0)


def scheduler_step_cost(k: int, sizes: list[int], seq_len: int, steps: int
                        ) -> dict[str, dict]:
    """Milliseconds of schedule() + update_from_output() per decode step, speculation off and
    on, with one token back per request (every draft rejected, the worst case for the
    proposer's work per token), on random and on repeating sequences of seq_len tokens."""
    from batchwire.v1 import worker_pb2

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.sampling_params import SamplingParams
    from scheduler_svc.core.scheduler import Scheduler

    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}
    for n in sizes:
        for kind in ("random", "repeating"):
            figures = {}
            for on in (False, True):
                config = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=16_384,
                                         max_model_len=2 * seq_len, speculative_method="ngram"
                                         if on else None, num_speculative_tokens=k)
                s = Scheduler(config, num_blocks=n * (seq_len // 16 + 8) + 1, block_size=16,
                              vocab_size=50_000)
                for _ in range(n):
                    ids = rng.integers(100, 49_000, size=seq_len if kind == "random" else 64)
                    s.add_request(np.resize(ids, seq_len).tolist(),
                                  SamplingParams(temperature=0, max_tokens=seq_len))
                # The next token continues a repeating sequence (its 4-grams always match) or
                # is random (hardly any 2-gram does).
                cycle = kind == "repeating"
                while s.waiting:  # prefill all
                    _step(s, worker_pb2, rng, cycle)
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(s, worker_pb2, rng, cycle)
                figures["on" if on else "off"] = 1e3 * (time.perf_counter() - t0) / steps
            out[f"{n} requests, {kind}"] = figures
    return out


def _step(s: Any, worker_pb2: Any, rng: np.random.Generator, cycle: bool) -> None:
    so = s.schedule()
    out = worker_pb2.ModelRunnerOutput()
    cached = so.scheduled_cached_reqs
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(cached.req_ids)
    out.req_ids.extend(ids)
    for req_id in ids:
        r = s.requests[req_id]
        entry = out.sampled_token_ids.add()
        if r.num_computed_tokens >= r.num_tokens:
            entry.ids.append(r.all_token_ids[-64] if cycle else int(rng.integers(100, 49_000)))
    s.update_from_output(so, out)


def _draw(fig: Any, results: dict) -> None:
    ax = fig.add_subplot(1, 1, 1)
    bars(ax, list(results), [r["tok_s"] for r in results.values()], "tokens/s")
