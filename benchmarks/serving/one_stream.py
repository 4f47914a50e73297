"""`batchwire bench latency`: one user's stream, one request at a time, through streamed
/v1/completions (greedy, EOS ignored, prompts as token ids): TTFT of a short and a long prompt and
TPOT at each output length, medians of --repeats runs. With `--llama-server PATH` (`make
llama-server` builds one), llama.cpp's server on the same GGUF file with the same thread count
takes turns with batchwire in the same run, and the report gives llama.cpp / batchwire ratios
(above 1: batchwire is faster).

Each repeat sends other prompts (fixed by their seed), so no run hits a prefix cache of the one
before; llama-server is also asked not to reuse its cached prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

from batchwire.benchmarks.serving.stream_client import StreamTiming, stream_completion
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report
from batchwire.benchmarks.shared.serve_process import ServeProcess
from batchwire.benchmarks.shared.workloads import random_fixed
from batchwire.common.model_files import resolve_model_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary: "
                   "measured in turns with batchwire on the same GGUF file (default: none, "
                   "batchwire alone)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the TTFT and "
                   "TPOT runs (default: %(default)s)")
    p.add_argument("--long-input-len", type=int, default=512, help="prompt tokens of the long "
                   "TTFT run (default: %(default)s)")
    p.add_argument("--output-lens", default="128,1024", help="output tokens of the TPOT runs, "
                   "comma list (default: %(default)s)")


def quick(args: argparse.Namespace) -> None:
    args.input_len, args.long_input_len, args.output_lens = 16, 32, "4,8"


def cases(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Name -> (prompt tokens, output tokens). The long prompt's run asks for 2 tokens: its
    TTFT is what it is for."""
    out = {f"ttft {args.long_input_len}": (args.long_input_len, 2)}
    for n in (int(x) for x in args.output_lens.split(",")):
        out[f"out {n}"] = (args.input_len, n)
    return out


def run(args: argparse.Namespace) -> None:
    model = resolve_model_path(args.model)
    todo = cases(args)
    context = max(p + n for p, n in todo.values()) + 16
    servers: dict[str, Callable[[], Any]] = {
        "batchwire": lambda: ServeProcess("--dtype", args.dtype, "--model", model)}
    if args.llama_server:
        from batchwire.benchmarks.shared.llama_server import LlamaServer

        servers["llama.cpp"] = lambda: LlamaServer(args.llama_server, model, args.threads,
                                                   context)
    # Both servers stay up; each run goes to one then the other, in turns.
    started: dict[str, Any] = {}
    runs: dict[str, dict[str, list[StreamTiming]]] = {s: {c: [] for c in todo} for s in servers}
    loads = []
    try:
        for name, start in servers.items():
            started[name] = start()
            stream_completion(started[name].http_url, [100, 200, 300], 4)  # warm-up
        for repeat in range(args.repeats):
            for i, (case, (prompt_len, n)) in enumerate(todo.items()):
                prompt = random_fixed(1, prompt_len, n, seed=1000 * repeat + i)[0][0]
                order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for name in order:
                    runs[name][case].append(stream_completion(started[name].http_url, prompt, n))
            loads.append(os.getloadavg()[0])
            print(f"  run {repeat + 1}/{args.repeats} done, load average {loads[-1]:.2f}",
                  flush=True)
    finally:
        for server in started.values():
            server.stop()
    llama_flags = getattr(started.get("llama.cpp"), "extra_flags", [])
    _report(args, model, todo, runs, loads, llama_flags)


def _median(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def summarise(todo: dict[str, tuple[int, int]], timings: dict[str, list[StreamTiming]]
              ) -> dict[str, dict[str, Any]]:
    """Per case: medians of TTFT and TPOT in ms (TPOT of the cases with more than 1 token)."""
    out = {}
    for case, (prompt_len, n) in todo.items():
        t = timings[case]
        out[case] = {"prompt_tokens": prompt_len, "output_tokens": n, "runs": len(t),
                     "ttft_ms": _median([x.ttft_s for x in t]),
                     "tpot_ms": _median([x.tpot_s for x in t]) if n > 2 else None}
    return out


def _report(args: argparse.Namespace, model: str, todo: dict[str, tuple[int, int]],
            runs: dict[str, dict[str, list[StreamTiming]]], loads: list[float],
            llama_flags: list[str]) -> None:
    report = Report("latency", machine_info(args.dtype), {**vars(args), "model": model})
    summary = {server: summarise(todo, timings) for server, timings in runs.items()}
    rows = []
    for server, s in summary.items():
        for case, m in s.items():
            tpot = m["tpot_ms"]
            rows.append([server, case, m["prompt_tokens"], m["output_tokens"],
                         f"{m['ttft_ms']:.1f}", "" if tpot is None else f"{tpot:.2f}",
                         "" if tpot is None else f"{1e3 / tpot:.1f}"])
    report.table(f"one stream, /v1/completions streamed, greedy; medians of {args.repeats} runs, "
                 f"{args.threads} threads", ["server", "case", "prompt", "output", "TTFT ms",
                                             "TPOT ms", "tok/s"], rows,
                 note=f"load average after each run: {', '.join(f'{x:.2f}' for x in loads)}"
                 + (f"; llama-server ran with {' '.join(llama_flags)} (its defaults crashed at "
                    "start here)" if llama_flags else ""))
    report.data.update(summary=summary, load_averages=loads, llama_server_flags=llama_flags,
                       runs={s: {c: [[x.ttft_s, x.tpot_s] for x in t] for c, t in r.items()}
                             for s, r in runs.items()})
    if "llama.cpp" in summary:
        ratios = {}
        for case, m in summary["batchwire"].items():
            peer = summary["llama.cpp"][case]
            if m["tpot_ms"] is not None:
                ratios[f"TPOT {case} (llama.cpp / batchwire)"] = peer["tpot_ms"] / m["tpot_ms"]
            ratios[f"TTFT {case} (llama.cpp / batchwire)"] = peer["ttft_ms"] / m["ttft_ms"]
        report.ratios("same run, in turns: above 1 = batchwire faster", ratios)
    report.save(args.results, lambda fig: _draw(fig, summary))


def _draw(fig: Any, summary: dict[str, dict[str, dict[str, Any]]]) -> None:
    for i, key in enumerate(("ttft_ms", "tpot_ms")):
        ax = fig.add_subplot(1, 2, i + 1)
        for j, (server, s) in enumerate(summary.items()):
            cases_ = [c for c, m in s.items() if m[key] is not None]
            ax.bar([k * (len(summary) + 1) + j for k in range(len(cases_))],
                   [s[c][key] for c in cases_], label=server,
                   color="tab:blue" if server == "batchwire" else "tab:gray")
            ax.set_xticks([k * (len(summary) + 1) for k in range(len(cases_))], cases_,
                          fontsize=8)
        ax.set_title(f"{key.split('_')[0].upper()} (ms, median)", fontsize=9)
        ax.legend(fontsize=7)
