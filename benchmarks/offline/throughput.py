"""`batchwire bench throughput`: offline throughput of batchwire on each transport against its
peers, all on the same machine in the same run, the configurations taking turns in each repeat.

Workload W64 by default, or --num-prompts N of --input-len ids with --output-len outputs.
Peers: transformers `generate` with static batches (same weights and dtype) and llama.cpp when
llama-cpp-python is installed. Useful output tokens count each request's own outputs only (a
static batch runs to its longest one); total tokens add the prompts. Also: the model FLOPs
utilisation against this run's measured matmul peak, and where a step's time goes.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from batchwire.benchmarks.offline.llamacpp_peer import load_llamacpp, run_llamacpp, skip_reason
from batchwire.benchmarks.offline.offline_w64 import (
    load_transformers,
    run_batchwire,
    run_transformers,
)
from batchwire.benchmarks.offline.step_profile import PARTS, profile_step
from batchwire.benchmarks.shared.cases import (
    async_setting,
    cpu_decode_cases,
    mode_setting,
    quantization_cases,
)
from batchwire.benchmarks.shared.machine import machine_info, peak_matmul_flops
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from batchwire.benchmarks.shared.workloads import Workload, random_fixed, token_counts, w64
from tqdm import tqdm

from scheduler_svc.executors.uni import UniProcExecutor


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, help="a random workload of this many prompts "
                   "instead of W64")
    p.add_argument("--input-len", type=int, default=128, help="with --num-prompts")
    p.add_argument("--output-len", type=int, default=128, help="with --num-prompts")
    p.add_argument("--transports", default="uni,zmq,grpc",
                   help="batchwire executors, comma list (`zmq sync`, `zmq async`: with async "
                   "scheduling off or on; plain zmq and grpc have it on) (default: "
                   "%(default)s)")
    p.add_argument("--hf-batch-sizes", default="16,64", help="transformers static batch sizes")
    p.add_argument("--no-llamacpp", action="store_true", help="leave the llama.cpp peer out")
    p.add_argument("--quantization", default="auto", help="the weights' --quantization, or a "
                   "comma-separated list to measure each (e.g. auto,none: the quantized "
                   "default beside the de-quantised reference; default: %(default)s)")
    p.add_argument("--cpu-decode", default="native", help="the workers' --cpu-decode, or a "
                   "comma-separated list to measure each (e.g. native,torch: the native decode "
                   "step and attention beside the torch path; default: %(default)s)")
    p.add_argument("--batch-invariant", action="store_true", help="also run each transport "
                   "in batch-invariant mode, in turns with the default (`uni invariant`)")


def quick(args: argparse.Namespace) -> None:
    args.num_prompts, args.input_len, args.output_len = args.num_prompts or 16, 32, 8


def workload_of(args: argparse.Namespace) -> tuple[str, Workload]:
    if args.num_prompts:
        return (f"random: {args.num_prompts} prompts of {args.input_len} tokens, "
                f"{args.output_len} output tokens",
                random_fixed(args.num_prompts, args.input_len, args.output_len))
    return "W64", w64()


def run(args: argparse.Namespace) -> None:
    from batchwire.common.model_files import resolve_model_path

    from scheduler_svc.engine.llm import LLM

    name, workload = workload_of(args)
    prompt_tokens, useful = token_counts(workload)
    max_len = max(len(p) + n for p, n in workload)
    # A quick run checks the code, not the machine: a 2048^3 bf16 matmul takes minutes on a CPU
    # without a native bf16 path (AVX2 only), so it samples a small one.
    peak_size = 256 if args.quick else 2048
    peaks = [peak_matmul_flops(args.dtype, peak_size)]
    settings = dict(model=args.model, dtype=args.dtype, max_num_seqs=min(len(workload), 256),
                    max_model_len=max_len, max_num_batched_tokens=max(2048, max_len),
                    kv_cache_memory_bytes=512 << 20,
                    enable_prefix_caching=False)  # every repeat a cold run, not the last one's hits
    transports = [t for t in args.transports.split(",") if t]
    if args.batch_invariant:
        transports += [f"{t} invariant" for t in transports]
    transports = cpu_decode_cases(quantization_cases(transports, args.quantization),
                                  args.cpu_decode)
    engines = {t: LLM(executor_backend=t.split()[0], **async_setting(t), **mode_setting(t),
                      **settings) for t in transports}
    configs: dict[str, Callable[[], float]] = {}
    steps: dict[str, int] = {}
    for t, llm in engines.items():
        run_batchwire(llm, workload[:8])  # warm-up: first-call allocations, lazy inits
        configs[f"batchwire {t}"] = _counting(llm, workload, steps, f"batchwire {t}")
    sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    if sizes:
        hf = load_transformers(args.model, args.dtype)
        run_transformers(hf, workload[:2], 2)
        for b in sizes:
            run = functools.partial(run_transformers, hf, workload, b)
            configs[f"transformers batch {b}"] = run
    path = resolve_model_path(args.model)
    skipped = "--no-llamacpp" if args.no_llamacpp else skip_reason(path)
    if skipped is None:
        cpp = load_llamacpp(path, max_len + 8, args.threads)
        configs["llama.cpp"] = lambda: run_llamacpp(cpp, workload)
    else:
        print(f"llama.cpp peer skipped: {skipped}")

    seconds: dict[str, list[float]] = {c: [] for c in configs}
    with tqdm(total=args.repeats * len(configs), desc="throughput", unit="run",
              disable=None) as bar:
        for _ in range(args.repeats):
            for c, fn in configs.items():  # in turns, so a drifting load hits every one alike
                bar.set_postfix_str(c)
                seconds[c].append(fn())
                bar.update(1)
            # A peak is the best the machine gives: sampled in every repeat, the highest kept,
            # so that a burst of load from elsewhere at one moment does not set it.
            peaks.append(peak_matmul_flops(args.dtype, peak_size))
    profile = profile_step(engines["uni"], workload) if "uni" in engines else None
    params = None
    if "uni" in engines:
        executor = engines["uni"].engine.executor
        assert isinstance(executor, UniProcExecutor)  # the model is in this process
        params = model_parameters(executor.worker.model)
    for llm in engines.values():
        llm.shutdown()

    report = Report("throughput", machine_info(args.dtype), {**vars(args), "workload": name,
                    "prompt_tokens": prompt_tokens, "useful_output_tokens": useful})
    results = {c: {"seconds": spread(s), "useful_tok_s": spread([useful / x for x in s]),
                   "total_tok_s": spread([(prompt_tokens + useful) / x for x in s])}
               for c, s in seconds.items()}
    peers = [c for c in results if not c.startswith("batchwire")]
    best = max(peers, key=lambda c: results[c]["useful_tok_s"]["median"], default=None)
    _tables(report, results, peers, best, name)
    report.data.update(results=results, best_peer=best, skipped={"llama.cpp": skipped})
    if params is not None:
        report.data["mfu"] = _mfu(report, results, params, prompt_tokens, useful,
                                  len(workload), peaks, args.dtype)
    if profile is not None:
        report.data["profile"] = _profile_table(report, profile, results, steps)
    report.save(args.results, lambda fig: _draw(fig, results, best, report.data.get("profile")))


def model_parameters(model: Any) -> int:
    """The model's weights, counted as --quantization none holds them: quantized linear layers
    hold codes, not parameters, and a tied LM head is the embedding's matrix (counted once)."""
    from worker_svc.quant.linear import QuantLinear

    tied = model.config.tie_word_embeddings
    return sum(p.numel() for p in model.parameters()) + sum(
        m.out_features * m.in_features for name, m in model.named_modules()
        if isinstance(m, QuantLinear) and not (tied and name == "lm_head"))


def _counting(llm: Any, workload: Workload, steps: dict[str, int], key: str) -> Callable:
    """run_batchwire that also records how many engine steps the run took."""
    def go() -> float:
        before = llm.engine.scheduler.stats.num_steps
        elapsed = run_batchwire(llm, workload)
        steps[key] = llm.engine.scheduler.stats.num_steps - before
        return elapsed
    return go


def _tables(report: Report, results: dict, peers: list[str], best: str | None,
            name: str) -> None:
    def ratio(c: str, peer: str | None) -> str:
        if peer is None:
            return "-"
        useful = {k: results[k]["useful_tok_s"]["median"] for k in (c, peer)}
        return f"{useful[c] / useful[peer]:.2f}x"

    columns = ["configuration", "useful out tok/s", "total tok/s", "wall s"]
    rows = [[c, fmt(r["useful_tok_s"]), fmt(r["total_tok_s"]), fmt(r["seconds"], 2)]
            for c, r in results.items()]
    if not report.quick:  # a quick run reports no speed ratio (report.py)
        columns.append("vs best peer")
        rows = [[*row, ratio(c, best)] for row, c in zip(rows, results, strict=True)]
    n = len(next(iter(results.values()))["seconds"]["runs"])
    report.table(f"{name}: median [min-max] of {n} runs", columns, rows,
                 note=f"best peer: {best}" if best else "no peer ran")
    ours = [c for c in results if c.startswith("batchwire")]
    if peers and ours and not report.quick:
        report.table("batchwire / each peer (useful output tok/s, medians)", ["peer", *ours],
                     [[p, *(ratio(c, p) for c in ours)] for p in peers])


def _mfu(report: Report, results: dict, params: int, prompt_tokens: int, useful: int,
         num_reqs: int, peaks: list[float], dtype: str) -> dict:
    """2 x parameters x tokens through the model / wall time / the measured matmul peak."""
    peak = max(peaks)
    tokens = prompt_tokens + useful - num_reqs  # a request's last output token is never fed back
    rows, out = [], {}
    for c in (c for c in results if c.startswith("batchwire")):
        flops = 2 * params * tokens / results[c]["seconds"]["median"]
        out[c] = {"flop_s": flops, "mfu": flops / peak}
        rows.append([c, f"{flops / 1e9:.1f}", f"{100 * flops / peak:.2f}%"])
    report.table(f"model FLOPs utilisation: 2 x {params / 1e6:.1f} M parameters x {tokens} tokens "
                 f"/ wall time, against this run's {dtype} matmul peak of {peak / 1e9:.0f} GFLOP/s "
                 f"(2048^3, best of {len(peaks)} samples)", ["configuration", "GFLOP/s", "MFU"],
                 rows)
    return {"parameters": params, "tokens": tokens, "peak_flop_s": peak,
            "peak_samples_flop_s": peaks, "configs": out}


def _profile_table(report: Report, profile: dict, results: dict, steps: dict) -> dict:
    rows = [[p, f"{v['ms_per_step']:.2f}", f"{100 * v['share']:.1f}%"]
            for p, v in profile["parts"].items()]
    uni = results.get("batchwire uni")
    for t in ("zmq", "grpc"):  # the transport: a remote run's extra wall time per step
        c = f"batchwire {t}"
        if uni and c in results and steps.get(c):
            extra = (results[c]["seconds"]["median"] - uni["seconds"]["median"]) / steps[c]
            profile["parts"][f"transport {t}"] = {"ms_per_step": 1e3 * extra}
            rows.append([f"transport {t}", f"{1e3 * extra:+.2f}", "-"])
    legend = "; ".join(f"{p}: {what}" for p, what in PARTS.items())
    report.table(f"one step, profiled: {profile['steps']} steps of one in-process run, "
                 f"{profile['total_s']:.2f} s", ["part", "ms/step", "share"], rows,
                 note=f"{legend}; transport: a remote run's median wall time per step less uni's")
    return profile


def _draw(fig: Any, results: dict, best: str | None, profile: dict | None) -> None:
    ax = fig.add_subplot(1, 2 if profile else 1, 1)
    labels = list(results)
    bars(ax, labels, [results[c]["useful_tok_s"] for c in labels], "useful output tokens/s")
    ax.set_title("throughput (median, min-max)", fontsize=9)
    if profile:
        ax2 = fig.add_subplot(1, 2, 2)
        parts = [p for p in PARTS if profile["parts"][p]["share"] > 0]
        ax2.barh(parts, [profile["parts"][p]["ms_per_step"] for p in parts], color="tab:orange")
        ax2.invert_yaxis()
        ax2.set_xlabel("ms per step (in-process)")
        ax2.set_title("where a step's time goes", fontsize=9)

