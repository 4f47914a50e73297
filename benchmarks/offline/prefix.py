"""`batchwire bench prefix`: requests sharing a 512-token prefix, with prefix caching on and off,
on one in-process worker (prefix_caching): median time to first token and total time; and a
workload with no shared prefix, where caching can only cost (its hashing and bookkeeping).
"""

from __future__ import annotations

import argparse
from typing import Any

from batchwire.benchmarks.offline.prefix_caching import compare
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from batchwire.benchmarks.shared.workloads import shared_prefix, w64
from tqdm import tqdm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32, help="each request's own tokens")
    p.add_argument("--output-len", type=int, default=32)


def quick(args: argparse.Namespace) -> None:
    args.num_prompts, args.output_len = 8, 4


def run(args: argparse.Namespace) -> None:
    shared = [p for p, _ in shared_prefix(args.num_prompts, args.prefix_len, args.suffix_len,
                                          args.output_len)]
    distinct = [p for p, _ in w64()][:args.num_prompts]
    with tqdm(total=4 * args.repeats, desc="prefix", unit="run", disable=None) as bar:
        raw = compare(shared, distinct, args.output_len, args.repeats, args.dtype, args.model,
                      on_run=lambda: bar.update(1))
    results = {f"{work}, cache {'on' if on else 'off'}": {
        field: spread([r[field] for r in runs]) for field in ("ttft", "total", "sched_cpu")}
        for (work, on), runs in raw.items()}

    report = Report("prefix", machine_info(args.dtype), vars(args))
    report.table(f"{args.num_prompts} requests, {args.output_len} output tokens each; shared: a "
                 f"{args.prefix_len}-token prefix + {args.suffix_len} own tokens; distinct: W64 "
                 f"prompts. Seconds, median [min-max] of {args.repeats} runs",
                 ["workload", "median TTFT s", "total s", "scheduler CPU ms"],
                 [[k, fmt(r["ttft"], 3), fmt(r["total"], 3), fmt(_ms(r["sched_cpu"]))]
                  for k, r in results.items()])

    def ratio(field: str, work: str) -> float:
        return (results[f"{work}, cache off"][field]["median"]
                / results[f"{work}, cache on"][field]["median"])

    ratios = {"shared prefix: TTFT, off / on": ratio("ttft", "shared"),
              "shared prefix: total, off / on": ratio("total", "shared"),
              "no shared prefix: total, off / on": ratio("total", "distinct")}
    report.ratios("same-run ratios (medians; above 1: caching is faster)", ratios)
    report.data.update(results=results)
    report.save(args.results, lambda fig: _draw(fig, results))


def _ms(s: dict) -> dict:
    return {k: [1e3 * x for x in v] if k == "runs" else 1e3 * v for k, v in s.items()}


def _draw(fig: Any, results: dict) -> None:
    for i, (field, label) in enumerate((("ttft", "median TTFT (s)"), ("total", "total (s)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        bars(ax, list(results), [r[field] for r in results.values()], label)
        ax.set_title(label, fontsize=9)
