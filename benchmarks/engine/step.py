"""`batchwire bench step`: CPU cost of one steady decode step at N running requests, apart from the
model: the worker's persistent batch against rebuilding it (runner_step), the scheduler's
schedule() and update_from_output() (scheduler_step), and each transport against its floor, a
bare echo of the same bytes (transport). Each repeat's figure is the median over its steps.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from batchwire.benchmarks.engine import runner_step, scheduler_step, transport
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from tqdm import tqdm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-reqs", type=int, default=256, help="running requests")
    p.add_argument("--waiting", type=int, default=1000, help="requests waiting behind them")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per repeat")


def quick(args: argparse.Namespace) -> None:
    args.num_reqs, args.waiting, args.steps = 64, 64, 30


def run(args: argparse.Namespace) -> None:
    n, steps, repeats = args.num_reqs, args.steps, args.repeats
    rows: dict[str, dict[str, Any]] = {}
    with tqdm(total=3, desc="step", unit="part", disable=None) as bar:
        bar.set_postfix_str("runner")
        for name, us in runner_step.measure(n, 200, steps, repeats).items():
            rows[f"runner inputs, {name} batch"] = spread(us)
        bar.update(1)
        bar.set_postfix_str("scheduler")
        sched: dict[str, list[float]] = {"schedule()": [], "update_from_output()": []}
        for _ in range(repeats):
            s, u, sizes = scheduler_step.measure(n, args.waiting, 128, steps)
            sched["schedule()"].append(statistics.median(s))
            sched["update_from_output()"].append(statistics.median(u))
        rows.update({f"scheduler {k}": spread(v) for k, v in sched.items()})
        bar.update(1)
        bar.set_postfix_str("transport")
        rounds, so_bytes, reply_bytes = transport.measure_steps(n, steps, repeats)
        rows.update({f"transport {k}": spread([statistics.median(r) for r in v])
                     for k, v in rounds.items()})
        bar.update(1)

    report = Report("step", machine_info(args.dtype), vars(args))
    med = {k: v["median"] for k, v in rows.items()}
    report.table(f"one steady decode step, {n} running requests ({args.waiting} waiting): "
                 f"microseconds, median [min-max] of {repeats} repeats of {steps} steps",
                 ["part", "us/step"], [[k, fmt(v)] for k, v in rows.items()],
                 note=f"SchedulerOutput {statistics.median(so_bytes):.0f} B, ModelRunnerOutput "
                 f"{reply_bytes} B; transports talk to a null worker in another process")
    ratios = {
        "rebuild / persistent batch":
            med["runner inputs, rebuild batch"] / med["runner inputs, persistent batch"],
        "zmq / its echo floor": med["transport zmq"] / med["transport zmq floor (echo)"],
        "grpc / its echo floor":
            med["transport grpc"] / med["transport grpc floor (sync echo)"],
        "grpc / zmq": med["transport grpc"] / med["transport zmq"],
    }
    report.ratios("same-run ratios (medians)", ratios)
    report.data.update(results=rows, scheduler_output_bytes=so_bytes,
                       model_runner_output_bytes=reply_bytes)
    report.save(args.results, lambda fig: _draw(fig, rows))


def _draw(fig: Any, rows: dict) -> None:
    ax = fig.add_subplot(1, 1, 1)
    bars(ax, list(rows), list(rows.values()), "microseconds per step")
    ax.set_yscale("log")
    ax.set_title("CPU cost of a decode step, apart from the model (median, min-max)", fontsize=9)
