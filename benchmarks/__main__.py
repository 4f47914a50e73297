"""`batchwire bench` (also `python -m batchwire.benchmarks`, `make bench`): measure batchwire
against its peers on this machine, in one run. Each benchmark prints its tables and writes
<name>.json and <name>.png into --results.

  throughput  offline tokens/s on each transport against transformers and llama.cpp
  serve       a Poisson load over the client gRPC API: TTFT, TPOT, ITL, end-to-end latency
  latency     one stream at a time over HTTP: TTFT and TPOT, against llama-server when given
  step        CPU cost per step: persistent batch vs rebuild, schedule(), each transport
  prefix      a shared 512-token prefix with prefix caching on and off
  spec        speculative decoding (n-gram drafts) off against K = 2, 4, 8, and on W64
  soak        a mixed load for --minutes (10): RSS, open fds, KV blocks and latency over time
  overhead    the engine's own time per decode step on a near-zero-cost model, by transport
  chaos       workers killed, frozen and drained in turn under load: every request intact
  lora        W64 on 4 LoRA adapters (a request on each in turn) against the base model alone
  hostile-http  hostile requests to the HTTP front beside a greedy stream: statuses, gap, RSS
  all         every one of them but hostile-http (a robustness check, not a measurement) and
              latency (its peer is a binary you build: `make llama-server`)
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from batchwire.benchmarks.shared.help_format import DefaultsSaid

# `batchwire bench NAME` -> the module that runs it (under batchwire.benchmarks) and one line of
# help; `all` runs them in this order. A new benchmark is one line here: its module has
# add_arguments(parser), quick(args) and run(args).
BENCHMARKS = {
    "throughput": ("offline.throughput",
                   "offline tokens/s on each transport against transformers and llama.cpp"),
    "serve": ("serving.serve",
              "a Poisson load over the client gRPC API: TTFT, TPOT, ITL, end-to-end latency"),
    "latency": ("serving.one_stream", "one stream at a time over HTTP: TTFT and TPOT, against "
                "llama-server when given"),
    "step": ("engine.step",
             "CPU cost per step: persistent batch vs rebuild, schedule(), each transport"),
    "prefix": ("offline.prefix", "a shared 512-token prefix with prefix caching on and off"),
    "spec": ("offline.spec",
             "speculative decoding (n-gram drafts) off against K = 2, 4, 8, and on W64"),
    "soak": ("reliability.soak",
             "a mixed load for --minutes: RSS, open fds, KV blocks and latency over time"),
    "overhead": ("engine.overhead",
                 "the engine's own time per decode step on a near-zero-cost model, by transport"),
    "chaos": ("reliability.chaos",
              "workers killed, frozen and drained in turn under load: every request intact"),
    "lora": ("offline.lora", "W64 on 4 LoRA adapters (a request on each in turn) against the "
             "base model alone"),
    "hostile-http": ("reliability.hostile_http", "hostile requests to the HTTP front beside a "
                     "greedy stream: statuses, gap, RSS"),
}
# What `all` runs: hostile-http checks the HTTP front's refusals rather than measuring speed;
# latency is about its llama-server peer, a binary `all` does not have.
MEASUREMENTS = [name for name in BENCHMARKS if name not in ("hostile-http", "latency")]


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The options every benchmark takes. Added to each sub-parser on its own (not through a
    shared parent parser): argparse shares a parent's option objects, so one benchmark's
    set_defaults(dtype=...) once changed every benchmark's default."""
    p.add_argument("--quick", action="store_true", help="a small workload on a tiny "
                   "random-weight model: checks the code runs, says nothing about speed")
    p.add_argument("--results", default="bench-results", help="folder for JSON and PNG "
                   "files (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the "
                   "median and spread are reported (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the model's dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads, of this process and of every worker (default: "
                   "%(default)s, the cores)")
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: the "
                   "embedded SmolLM2-135M-Instruct)")


def build_parser() -> argparse.ArgumentParser:
    # The first paragraph alone: the sub-command list below names each benchmark with its help.
    parser = argparse.ArgumentParser(prog="batchwire bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK",
                                title="benchmarks")
    for name in BENCHMARKS:
        module = _module(name)
        p = sub.add_parser(name, help=BENCHMARKS[name][1], description=module.__doc__,
                           formatter_class=DefaultsSaid)
        add_common_arguments(p)
        module.add_arguments(p)
    every = sub.add_parser("all", help="every benchmark but hostile-http and latency, with "
                           "its defaults", formatter_class=DefaultsSaid)
    add_common_arguments(every)
    return parser


def _module(name: str):
    return importlib.import_module(f"batchwire.benchmarks.{BENCHMARKS[name][0]}")


def _unwind(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so that each benchmark's `finally`
    # stops the servers and workers it started: they run in process groups of their own, which
    # a signal to this one's does not reach.
    signal.signal(signal.SIGTERM, _unwind)
    args = build_parser().parse_args(argv)
    from batchwire.benchmarks.shared.machine import set_threads

    set_threads(args.threads)
    every = args.benchmark == "all"
    parser = build_parser()
    for name in MEASUREMENTS if every else [args.benchmark]:
        module = _module(name)
        if every:  # this benchmark's own defaults under the common options given
            args = parser.parse_args([name, *(argv if argv is not None else sys.argv[1:])[1:]])
        if args.quick:
            args.repeats = min(args.repeats, 2)
            if args.model is None:
                from batchwire.benchmarks.shared.tiny_model import tiny_model

                args.model = tiny_model(Path(args.results) / ".tiny-model")
            module.quick(args)
        t0 = time.perf_counter()
        print(f"== batchwire bench {name}{' --quick' if args.quick else ''}", flush=True)
        module.run(args)
        print(f"== {name} took {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
