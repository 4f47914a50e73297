"""Workload W64 offline: useful output tokens per second of LLM.generate against transformers'
generate with static batches, on the same weights and dtype, in the same run.

W64 (design brief): 64 requests, seed 0, prompt ids uniform in [100, 49000), prompt lengths
uniform in [32, 256], output lengths uniform in [16, 128], ignore_eos, greedy. Model loading is
not timed. A static batch runs until its longest request is done; only each request's own output
tokens count as useful.

    .venv/bin/python -m batchwire.benchmarks.offline.offline_w64 --dtype bfloat16 \
        --hf-batch-sizes 16,64 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.workloads import Workload, w64


def run_batchwire(llm, workload: Workload) -> float:
    """Seconds for LLM.generate to run the whole workload."""
    from scheduler_svc import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    t0 = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outputs] == [n for _, n in workload]
    return elapsed


def load_transformers(model: str | None, dtype: str):
    """transformers' own reading of the checkpoint directory or GGUF file (None = the default)."""
    from batchwire.common.model_files import resolve_model_path
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # NOTE: its GGUF loader warns that packed weights are faster in float32, also when (as here,
    # with no GGUF kernel installed) it de-quantises to plain dtype Linear layers anyway.
    hf_logging.set_verbosity(logging.ERROR)
    path = resolve_model_path(model)
    folder, name = os.path.split(path) if path.endswith(".gguf") else (path, None)
    return AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()


def run_transformers(model, workload: Workload, batch_size: int) -> float:
    """Seconds for static batches in workload order, left padded, each run to its longest
    output."""
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch-sizes", default="16,64", help="comma list; empty = skip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = w64()
    useful = sum(n for _, n in workload)
    print(f"W64: {len(workload)} requests, {useful} useful output tokens, dtype {args.dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")

    from scheduler_svc import LLM

    # Prefix caching off: otherwise every repeat after the first reuses the last one's prefill.
    llm = LLM(dtype=args.dtype, max_num_seqs=64, max_model_len=512,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    run_batchwire(llm, workload[:4])  # warm-up: first-call allocations, lazy inits
    sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    model = load_transformers(None, args.dtype) if sizes else None

    # Each repeat runs every configuration once, so drifting load on a shared machine hits all.
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        results.setdefault("batchwire LLM.generate", []).append(
            useful / run_batchwire(llm, workload))
        for b in sizes:
            results.setdefault(f"transformers generate, batch {b}", []).append(
                useful / run_transformers(model, workload, b))

    best_peer = max((statistics.median(v) for k, v in results.items() if "transformers" in k),
                    default=None)
    for k, v in results.items():
        med = statistics.median(v)
        ratio = f"  {med / best_peer:5.2f}x best peer" if best_peer else ""
        runs = ", ".join(f"{x:.0f}" for x in v)
        print(f"  {k:34s} {med:8.1f} useful tok/s  (runs: {runs}){ratio}")


if __name__ == "__main__":
    main()
