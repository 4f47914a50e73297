"""`batchwire bench overhead`: the engine's own time per decode step. The whole engine drives a
model whose forward pass costs almost nothing (1 layer, hidden 64, vocabulary 512, random
weights, the default tokenizer: benchmarks/shared/tiny_model.py), so what a step costs is the
engine: the offline engine on each transport (uni, zmq, grpc) and a `batchwire serve` process
driven over the client gRPC API (its step read as the clients' time per output token). Next to
it, measured in the same run, the bare transformers decode step of the same model and batch. An
offline case's "engine thread" row is its step less the output processor's time: what a server's
engine thread does, its text being made on the event loop. Where the time goes comes from one
extra run with a timer around each part (not one of the timed runs). --model is
ignored: the near-zero-cost model is the point.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from batchwire.benchmarks.engine.overhead_parts import PARTS, profile_parts
from batchwire.benchmarks.engine.overhead_remote import RemoteStepTimes, report_overlap
from batchwire.benchmarks.serving.load_generator import generate_load
from batchwire.benchmarks.shared.cases import async_setting
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from batchwire.benchmarks.shared.serve_process import ServeProcess
from batchwire.benchmarks.shared.splits import Splits
from batchwire.benchmarks.shared.tiny_model import tiny_model

from scheduler_svc.core.sampling_params import SamplingParams

VOCAB = 512
ENGINE_TRANSPORTS = ("uni", "zmq", "grpc")
SPEC: dict[str, Any] = dict(speculative_method="ngram", num_speculative_tokens=4)  # `spec`


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-reqs", default="64,256", help="decoding requests, comma list "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--cases", default="uni,zmq,grpc,serve uni,serve zmq",
                   help="engine transports (`zmq async` / `zmq sync`: with async scheduling "
                   "on / off, whatever --async-scheduling says; plain `zmq`: the engine's "
                   "default, on over zmq and grpc; `zmq spec`, `zmq async spec`: with n-gram "
                   "speculative decoding, K=4) and `serve <transport>` processes, comma list "
                   "(default: %(default)s)")
    # float32: on a CPU without AMX, bfloat16 makes even this model's matmuls the bottleneck.
    p.set_defaults(dtype="float32")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engines' setting (default: theirs; serve gets the flag when on)")


def quick(args: argparse.Namespace) -> None:
    args.num_reqs, args.steps, args.cases = "16", 8, "uni,zmq async"


def run(args: argparse.Namespace) -> None:
    model = tiny_model(Path(args.results) / ".overhead-model", num_layers=1, vocab_size=VOCAB)
    sizes = [int(n) for n in args.num_reqs.split(",")]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    step_ms: dict[str, dict[str, Any]] = {}  # "<case>, <n>" -> spread of ms per step
    parts: dict[str, dict[str, float]] = {}  # "<case>, <n>" -> ms per step of each part
    floor_ms: dict[int, dict[str, Any]] = {}
    thread_lists: dict[str, list[float]] = {}  # "<case>, <n>" -> the engine thread's ms per step
    # "<case>, <n>" of a remote worker -> "step", "wait", "engine", "worker": mean ms per step,
    # one figure per repeat (RemoteStepTimes)
    sides: dict[str, dict[str, list[float]]] = {}
    async_cases: set[str] = set()  # "<case>, <n>" whose engine ran with async scheduling
    for n in sizes:
        floor_ms[n] = spread(bare_forward_ms(model, n, args.prompt_len, args.steps,
                                             args.repeats, args.dtype))
        runs = measure_engines(model, n, args,
                               [c for c in cases if c.split()[0] in ENGINE_TRANSPORTS], parts,
                               thread_lists, sides, async_cases)
        for case in cases:
            if case.startswith("serve "):
                runs[case] = measure_serve(model, n, args, case.split()[1])
        for case, case_ms in runs.items():
            step_ms[f"{case}, {n}"] = spread(case_ms)

    report = Report("overhead", machine_info(args.dtype), vars(args))
    rows, ratios = [], {}
    thread_ms: dict[str, dict[str, Any]] = {}
    for key, s in step_ms.items():
        n = int(key.rsplit(", ", 1)[1])
        ratio = s["median"] / floor_ms[n]["median"]
        ratios[f"{key}: step / bare forward"] = ratio
        rows.append([key, fmt(s, 2), f"{1e3 * s['median'] / n:.1f}",
                     *([] if report.quick else [f"{ratio:.2f}"])])
        if key in thread_lists:
            t = thread_ms[key] = spread(thread_lists[key])
            ratio = t["median"] / floor_ms[n]["median"]
            ratios[f"{key}: engine thread / bare forward"] = ratio
            rows.append([f"{key}, engine thread", fmt(t, 2), f"{1e3 * t['median'] / n:.1f}",
                         *([] if report.quick else [f"{ratio:.2f}"])])
        for who in ("engine", "worker"):
            if key in sides:
                t = spread(sides[key][who])
                ratio = t["median"] / floor_ms[n]["median"]
                ratios[f"{key}: {who}'s own / bare forward"] = ratio
                rows.append([f"{key}, {who}'s own", fmt(t, 2), f"{1e3 * t['median'] / n:.1f}",
                             *([] if report.quick else [f"{ratio:.2f}"])])
    for n, s in floor_ms.items():
        rows.append([f"bare transformers forward + argmax, {n}", fmt(s, 2),
                     f"{1e3 * s['median'] / n:.1f}", *([] if report.quick else ["1.00"])])
    report.table(f"a decode step on a near-zero-cost model (1 layer, hidden 64, vocab {VOCAB}), "
                 f"prompts of {args.prompt_len}: median [min-max] of {args.repeats} repeats of "
                 f"{args.steps} steps", ["case, requests", "ms/step", "us/request/step",
                                         *([] if report.quick else ["x bare forward"])], rows,
                 note="engine thread: the offline step less its output processor (text, stop "
                 "strings), i.e. what a server's engine thread does; with a remote worker, "
                 "engine's own: the step less its waits on the worker's replies (send and "
                 "wait, the wire included), worker's own: the worker's time inside its "
                 "ExecuteModel and SampleTokens handlers (its Prometheus histograms), both "
                 "mean ms per step (per step in spec cases too); spec cases: the time of "
                 "n output tokens (a step may keep several of a request, or none); serve: the "
                 "median time per output token its clients saw; the machine may be shared and "
                 "loaded (see the load average)")
    report_overlap(report, sides, async_cases, args.repeats, ratios)
    for key, ms in parts.items():
        total = sum(ms.values())
        report.table(f"where the time goes, {key} (one profiled run, ms per step)",
                     ["part", "ms/step", "share"],
                     [[p, f"{v:.3f}", f"{100 * v / total:.0f}%"] for p, v in ms.items()],
                     note="; ".join(f"{p}: {PARTS[p]}" for p in ms))
    report.data.update(step_ms=step_ms, engine_thread_ms=thread_ms, remote_sides_ms=sides,
                       bare_forward_ms={str(n): s for n, s in floor_ms.items()}, parts=parts)
    report.ratios("a step against the bare forward pass of its batch", ratios)
    report.save(args.results, lambda fig: _draw(fig, step_ms, floor_ms))


def prompts(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(n)]


def engine_settings(n: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """One step prefills every prompt; the pool holds every request whole."""
    return dict(max_num_seqs=n, max_num_batched_tokens=max(n * prompt_len, 2048),
                max_model_len=prompt_len + max_tokens + 16, kv_cache_memory_bytes=64 << 20,
                enable_prefix_caching=False)


def measure_engines(model: str, n: int, args: argparse.Namespace, transports: list[str],
                    parts: dict[str, dict[str, float]], thread_ms: dict[str, list[float]],
                    sides: dict[str, dict[str, list[float]]], async_cases: set[str]
                    ) -> dict[str, list[float]]:
    """ms per decode step of each transport, one figure per repeat (the transports take turns);
    fills thread_ms["<transport>, <n>"] with the token-level part of the same steps,
    sides["<transport>, <n>"] with a remote worker's two sides of them (and async_cases with
    those whose engine scheduled asynchronously, by its flag or its default), and
    parts["<transport>, <n>"] from one extra, profiled run on each."""
    from scheduler_svc.engine.llm import LLM

    warmup = 4
    max_tokens = warmup + args.steps + 4
    default = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}
    engines = {t: LLM(model, dtype=args.dtype, executor_backend=t.split()[0],
                      **async_setting(t, default),
                      **(SPEC if "spec" in t.split() else {}),
                      **engine_settings(n, args.prompt_len, max_tokens)) for t in transports}
    runs: dict[str, list[float]] = {t: [] for t in transports}
    remote = {t: RemoteStepTimes(llm.engine) for t, llm in engines.items() if t.split()[0] != "uni"}
    try:
        for _ in range(args.repeats):
            for t, llm in engines.items():
                thread: list[float] = []
                tokens: list[int] = []
                times = decode_steps(llm.engine, n, args, warmup, thread_times=thread,
                                     tokens=tokens, remote=remote.get(t))
                if t in remote:  # per step, whatever a step keeps
                    wait, worker = remote[t].measured
                    side = sides.setdefault(f"{t}, {n}", {})
                    mean = statistics.fmean(times)
                    for name, value in (("step", mean), ("wait", wait),
                                        ("engine", mean - wait), ("worker", worker)):
                        side.setdefault(name, []).append(value)
                    if llm.engine.async_scheduling:
                        async_cases.add(f"{t}, {n}")
                if "spec" in t.split():
                    # A step may keep several tokens of a request, or (async: two halves of
                    # the requests take turns) none: the time of n output tokens instead.
                    scale = n / sum(tokens)
                    runs[t].append(sum(times) * scale)
                    thread_ms.setdefault(f"{t}, {n}", []).append(sum(thread) * scale)
                    continue
                runs[t].append(statistics.median(times))
                thread_ms.setdefault(f"{t}, {n}", []).append(statistics.median(thread))
        for t, llm in engines.items():
            timer = remote.get(t)

            def profiled(splits: Splits, engine: Any = llm.engine,
                         r: RemoteStepTimes | None = timer) -> list[float]:
                return decode_steps(engine, n, args, warmup, splits, remote=r)

            parts[f"{t}, {n}"] = profile_parts(llm.engine, profiled, timer)
    finally:
        for r in remote.values():
            r.close()
        for llm in engines.values():
            llm.shutdown()
    return runs


def decode_steps(engine: Any, n: int, args: argparse.Namespace, warmup: int,
                 splits: Splits | None = None, thread_times: list[float] | None = None,
                 tokens: list[int] | None = None, remote: RemoteStepTimes | None = None
                 ) -> list[float]:
    """Adds n requests, runs their prefill and `warmup` steps, then times args.steps decode
    steps one by one (ms each), with the splits' timers on; aborts what is left. thread_times
    gets each step's token-level part (the step less its output processor, which an offline
    async step runs while the worker computes), tokens the output tokens of each step; remote,
    the worker's and the wait's time over the timed steps (remote.measured)."""
    params = SamplingParams(temperature=0, max_tokens=warmup + args.steps + 4, ignore_eos=True)
    ids = [f"overhead-{time.monotonic_ns()}-{i}" for i in range(n)]
    for request_id, prompt in zip(ids, prompts(n, args.prompt_len), strict=True):
        engine.add_request(prompt, params, request_id=request_id)
    started: set[str] = set()
    while len(started) < n:  # prefill: every request has its first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    for _ in range(warmup):
        engine.step()
    times = []
    if splits is not None:
        splits.enabled = True
    if remote is not None:
        remote.start()
    processing = [0.0]  # this step's time in the output processor
    process_outputs = engine.process_outputs

    def timed_process_outputs(outputs: list) -> list:
        t = time.perf_counter()
        try:
            return process_outputs(outputs)
        finally:
            processing[0] += time.perf_counter() - t

    engine.process_outputs = timed_process_outputs
    for _ in range(args.steps):
        processing[0] = 0.0
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        times.append(1e3 * elapsed)
        if tokens is not None:
            tokens.append(sum(len(o.new_token_ids) for o in outputs))
        if thread_times is not None:
            thread_times.append(1e3 * (elapsed - processing[0]))
    del engine.process_outputs  # the class's again
    if splits is not None:
        splits.enabled = False
    if remote is not None:
        remote.stop(args.steps)
    engine.abort_requests(ids)
    while engine.has_requests():
        engine.step()
    return times


def measure_serve(model: str, n: int, args: argparse.Namespace, transport: str) -> list[float]:
    """The clients' median time per output token (ms; TPOT, first to last message) of n streams
    decoding together, a figure per repeat, against `batchwire serve --transport <transport>`.
    Not the gap between messages: when the engine thread runs ahead of the event loop, a
    message carries several tokens, and the gap overstates the step."""
    max_tokens = args.steps + 8
    settings = engine_settings(n, args.prompt_len, max_tokens)
    server = ServeProcess(
        "--model", model, "--dtype", args.dtype, "--transport", transport,
        "--max-num-seqs", str(n), "--max-num-batched-tokens",
        str(settings["max_num_batched_tokens"]), "--max-model-len", str(settings["max_model_len"]),
        "--kv-cache-memory", "64M", "--no-prefix-caching",
        *(["--async-scheduling"] if args.async_scheduling else []))
    runs = []
    try:
        generate_load(server.address, [(prompts(2, args.prompt_len, -1)[0], 4)] * 2,
                      float("inf"), 2, desc="warm-up")
        for repeat in range(args.repeats):
            workload = [(p, max_tokens) for p in prompts(n, args.prompt_len, seed=repeat)]
            records, _ = generate_load(server.address, workload, float("inf"), n,
                                       desc=f"serve {transport}, {n} streams")
            failed = [r.error for r in records if r.error or r.num_output_tokens != max_tokens]
            assert not failed, f"serve {transport}: {len(failed)} streams failed: {failed[:2]}"
            runs.append(1e3 * statistics.median(
                (r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1)
                for r in records))
    finally:
        server.stop()
    return runs


def bare_forward_ms(model: str, n: int, prompt_len: int, steps: int, repeats: int,
                    dtype: str) -> list[float]:
    """The floor: transformers' decode step of the same model and batch (a KV cache, one token
    per request, argmax), ms per step, the median of `steps` steps per repeat."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf.eval()
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            ids = torch.tensor(prompts(n, prompt_len))
            out = hf(input_ids=ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(steps + 4):
                t0 = time.perf_counter()
                out = hf(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                times.append(1e3 * (time.perf_counter() - t0))
            runs.append(statistics.median(times[4:]))
    return runs


def _draw(fig: Any, step_ms: dict[str, dict], floor_ms: dict[int, dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    labels = list(step_ms) + [f"transformers forward, {n}" for n in floor_ms]
    bars(ax, labels, [*step_ms.values(), *floor_ms.values()], "ms per decode step")
    ax.set_title("the engine's time per step on a near-zero-cost model (median, min-max)",
                 fontsize=9)
