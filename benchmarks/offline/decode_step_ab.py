"""The one-stream decode step before and after worker_svc/models/step_ops.py, in one process and
in turns: A patches main's ops back in (the kernels' rotary, norm and K/V write per layer; the
gather path of paged attention), B runs the model as it is. Prints TPOT medians, A/B, whether the
tokens agree, and aten ops per decode step under torch.profiler (a count no load changes).

    .venv/bin/python -m batchwire.benchmarks.offline.decode_step_ab --threads 1 --tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from batchwire import kernels
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.kernels import paged_attention_cpu

import worker_svc.models.llama as llama
import worker_svc.models.step_ops as step_ops


@contextlib.contextmanager
def main_ops() -> Iterator[None]:
    saved = (step_ops.StepTables.build, llama.rms_norm, paged_attention_cpu._one_run)
    step_ops.StepTables.build = classmethod(  # type: ignore[method-assign, assignment]
        lambda cls, positions, table, head_dim: cls(positions, table))
    llama.rms_norm = kernels.rms_norm
    paged_attention_cpu._one_run = lambda table, seq_len: None
    try:
        yield
    finally:
        (step_ops.StepTables.build, llama.rms_norm,  # type: ignore[method-assign]
         paged_attention_cpu._one_run) = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per timed run")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from scheduler_svc import SamplingParams
    from scheduler_svc.engine.llm import LLM

    llm = LLM(dtype="bfloat16", max_model_len=2048)
    prompt = [list(range(100, 228))]

    def generate(n: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].token_ids)

    sides: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "A (main)": main_ops, "B (now)": contextlib.nullcontext}
    tpot: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in (list(sides) if repeat % 2 else list(sides)[::-1]):
            with sides[name]():
                one, _ = generate(1)
                many, tokens[name] = generate(args.tokens)
            if repeat:
                tpot[name].append(1e3 * (many - one) / (args.tokens - 1))
        print(f"round {repeat}: {tpot}, load average {os.getloadavg()[0]:.2f}", flush=True)
    a, b = (statistics.median(v) for v in tpot.values())
    print(f"TPOT ms: A {a:.2f}, B {b:.2f}, A/B {a / b:.3f}; same tokens: "
          f"{tokens['A (main)'] == tokens['B (now)']}")
    from torch.profiler import profile

    for name, side in sides.items():
        counts = []
        with side():
            for n in (1, 17):
                with profile() as prof:
                    generate(n)
                counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
        print(f"{name}: {(counts[1] - counts[0]) / 16:.0f} aten ops per decode step")


if __name__ == "__main__":
    main()
