"""`batchwire bench serve`: a Poisson load over the client gRPC API of a `batchwire serve` started
for the run: TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request and token
throughput, at each request rate. Each repeat sends other prompts, so no run hits the prefix cache
of the one before.

`--api grpc,openai` runs the same loads through the OpenAI-compatible HTTP API too (streamed
/v1/completions), in turns with gRPC on the same server, and reports HTTP / gRPC ratios.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from batchwire.benchmarks.serving.latency import PERCENTILES, serving_metrics
from batchwire.benchmarks.serving.load_generator import generate_load
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report
from batchwire.benchmarks.shared.serve_process import ServeProcess
from batchwire.benchmarks.shared.workloads import random_fixed

METRICS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rates", default="1,2,4", help="requests/s, comma list; inf = all "
                   "at once (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--api", default="grpc", help="client APIs, comma list of grpc and openai "
                   "(the HTTP front), each run in turn on the same server (default: %(default)s)")


def quick(args: argparse.Namespace) -> None:
    args.request_rates, args.num_prompts, args.input_len, args.output_len = "8,inf", 8, 32, 8


def run(args: argparse.Namespace) -> None:
    rates = [float(r) for r in args.request_rates.split(",")]
    apis = args.api.split(",")
    if not apis or set(apis) - {"grpc", "openai"}:
        raise SystemExit(f"bench serve: --api takes grpc and/or openai, got {args.api!r}")
    serve_args = ["--dtype", args.dtype, "--max-model-len", str(args.input_len + args.output_len),
                  "--kv-cache-memory", "512M", "--max-num-seqs", str(args.max_concurrency)]
    server = ServeProcess(*serve_args, *(["--model", args.model] if args.model else []))
    runs: dict[str, list[dict]] = {_key(a, r): [] for r in rates for a in apis}
    address = {"grpc": server.address, "openai": server.http_url}
    try:
        for api in apis:
            generate_load(address[api], random_fixed(2, args.input_len, 4, seed=-1),
                          float("inf"), 2, desc=f"warm-up {api}", api=api)
        for repeat in range(args.repeats):
            for i, rate in enumerate(rates):  # in turns, so a drifting load hits all alike
                for j, api in enumerate(apis):
                    # Other prompts for each API: neither hits the other's prefix cache.
                    workload = random_fixed(args.num_prompts, args.input_len, args.output_len,
                                            seed=1000 * repeat + 10 * i + j)
                    records, duration = generate_load(
                        address[api], workload, rate, args.max_concurrency, seed=repeat,
                        desc=f"{api} {rate:g} req/s, run {repeat + 1}", api=api)
                    runs[_key(api, rate)].append(serving_metrics(records, duration))
    finally:
        server.stop()

    report = Report("serve", machine_info(args.dtype), {**vars(args), "serve_args": serve_args})
    summary = {k: _median_of_runs(m) for k, m in runs.items()}
    n = args.repeats
    report.table(
        f"serve: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output "
        f"tokens, max concurrency {args.max_concurrency}; medians of {n} runs",
        ["api, rate req/s" if len(apis) > 1 else "rate req/s", "done", "failed", "req/s",
         "out tok/s", "total tok/s"],
        [[r, f"{s['completed']:g}", f"{s['failed']:g}", f"{s['request_throughput']:.2f}",
          f"{s['output_tok_s']:.1f}", f"{s['total_tok_s']:.1f}"] for r, s in summary.items()])
    report.table("latency in ms (each figure the median over runs)",
                 ["rate req/s, metric", "mean", *(f"p{p}" for p in PERCENTILES), "p99/p50"],
                 [[f"{r} {label}", *(f"{s[key][q]:.1f}" for q in ("mean", "p50", "p90", "p99")),
                   f"{s[key]['p99'] / s[key]['p50']:.2f}"]
                  for r, s in summary.items() for key, label in METRICS.items()])
    if len(apis) > 1:
        _ratio_table(report, summary, rates)
    errors = sorted({e for m in runs.values() for run in m for e in run["errors"]})
    if errors:
        print(f"  errors: {errors}")
    report.data.update(runs=runs, summary=summary)
    report.save(args.results, lambda fig: _draw(fig, summary))


def _key(api: str, rate: float) -> str:
    """A run's name: the rate alone for gRPC (as before --api existed), else "api rate"."""
    return f"{rate:g}" if api == "grpc" else f"{api} {rate:g}"


def _ratio_table(report: Report, summary: dict, rates: list[float]) -> None:
    """HTTP / gRPC, same server, same run: throughput below 1 and latencies above 1 are the HTTP
    front's cost."""
    rows, ratios = [], {}
    for rate in rates:
        h, g = summary[_key("openai", rate)], summary[_key("grpc", rate)]
        r = {"out tok/s": h["output_tok_s"] / g["output_tok_s"],
             "TTFT p50": h["ttft_ms"]["p50"] / g["ttft_ms"]["p50"],
             "TPOT p50": h["tpot_ms"]["p50"] / g["tpot_ms"]["p50"],
             "ITL p50": h["itl_ms"]["p50"] / g["itl_ms"]["p50"]}
        ratios[f"{rate:g}"] = r
        rows.append([f"{rate:g}", *(f"{v:.3f}" for v in r.values())])
    report.table("OpenAI HTTP API / gRPC API (same server, in turns)",
                 ["rate req/s", "out tok/s", "TTFT p50", "TPOT p50", "ITL p50"], rows)
    report.data["ratios_openai_over_grpc"] = ratios


def _median_of_runs(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {q: statistics.median(r[key][q] for r in runs) for q in value}
        elif isinstance(value, int | float):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _draw(fig: Any, summary: dict) -> None:
    rates = list(summary)
    for i, (key, label) in enumerate(METRICS.items()):
        ax = fig.add_subplot(1, len(METRICS), i + 1)
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(rates, [summary[r][key][q] for r in rates], style, label=q)
        ax.set_title(f"{label} (ms)", fontsize=9)
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        if i == 0:
            ax.legend(fontsize=7)
