"""`batchwire bench lora`: W64 with each request on one of 4 LoRA adapters against the base model
alone, on one in-process worker with 4 adapter slots, in the same run.

The adapters are random, rank --rank, on every attention and MLP projection, written in PEFT's
format (adapter_config.json + adapter_model.safetensors) into --results. Both runs use the same
worker (the base run then also shows what the slots cost a step that uses none); prefix caching
is off, so a repeat recomputes its prompts. Useful output tokens per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report, bars, fmt, spread
from batchwire.benchmarks.shared.workloads import w64
from tqdm import tqdm

NUM_ADAPTERS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64, help="W64's requests")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")


def quick(args: argparse.Namespace) -> None:
    args.num_requests, args.rank = 8, 8


def run(args: argparse.Namespace) -> None:
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.lora_request import LoRARequest
    from scheduler_svc.core.tokenizer import load_tokenizer
    from worker_svc.runner.worker import Worker

    config = SchedulerConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=64, max_model_len=512,
        enable_prefix_caching=False, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank,
        kv_cache_memory_bytes=(16 << 20) if args.quick else (1 << 30),
    )  # fmt: skip
    worker = Worker(config.worker_config())
    tokenizer = load_tokenizer(args.model)
    folder = Path(args.results) / ".lora-adapters"
    paths = [write_random_adapter(folder / str(i), worker, args.rank, i)
             for i in range(NUM_ADAPTERS)]
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    workload = w64(n=args.num_requests)

    def engine() -> Any:
        from scheduler_svc.engine.engine_core import EngineCore
        from scheduler_svc.executors.uni import UniProcExecutor

        worker.reset()
        return EngineCore(config, UniProcExecutor(config, worker), tokenizer)

    _w64(engine(), workload[:4], [None] * 4)  # warm-up: first-call allocations
    _w64(engine(), workload[:4], loras)  # and the adapters' first reads into their slots
    runs: dict[str, list[float]] = {"base": [], f"{NUM_ADAPTERS} adapters": []}
    with tqdm(total=2 * args.repeats, desc="lora", unit="run", disable=None) as bar:
        for _ in range(args.repeats):  # both once per repeat: drift hits both
            runs["base"].append(_w64(engine(), workload, [None] * len(workload)))
            bar.update(1)
            per_request = [loras[i % NUM_ADAPTERS] for i in range(len(workload))]
            runs[f"{NUM_ADAPTERS} adapters"].append(_w64(engine(), workload, per_request))
            bar.update(1)
    results = {name: spread(r) for name, r in runs.items()}

    report = Report("lora", machine_info(args.dtype), vars(args))
    report.table(
        f"W64 ({args.num_requests} requests), useful output tokens/s, median [min-max] of "
        f"{args.repeats} runs; adapters: request i on adapter i mod {NUM_ADAPTERS}, rank "
        f"{args.rank}, all 7 projections",
        ["requests", "tokens/s"],
        [[name, fmt(r)] for name, r in results.items()],
    )
    ratio = results[f"{NUM_ADAPTERS} adapters"]["median"] / results["base"]["median"]
    report.ratios(
        "same-run ratio (medians; 1 = adapters cost nothing; the aim is >= 0.7)",
        {f"W64: tokens/s, {NUM_ADAPTERS} adapters / base": ratio},
    )
    report.data.update(results=results)
    report.save(args.results, lambda fig: bars(fig.add_subplot(1, 1, 1), list(results),
                                               list(results.values()), "tokens/s"))


def write_random_adapter(folder: Path, worker: Any, rank: int, seed: int) -> str:
    """A random LoRA in PEFT's format for the worker's model: every layer's 7 projections."""
    import torch
    from safetensors.torch import save_file

    from worker_svc.lora.peft_adapter import PROJECTIONS, projection_shapes

    cfg = worker.model.config
    shapes = projection_shapes(cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in PROJECTIONS:
            fan_in, fan_out = shapes[proj]
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            a = torch.randn(rank, fan_in, generator=generator)
            b = torch.randn(fan_out, rank, generator=generator)
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = 0.02 * a, 0.02 * b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(PROJECTIONS), "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def _w64(engine: Any, workload: list[tuple[list[int], int]], loras: list[Any]) -> float:
    from scheduler_svc import SamplingParams

    for i, ((prompt, n), lora) in enumerate(zip(workload, loras, strict=True)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           request_id=str(i), lora=lora)
    t0 = time.perf_counter()
    while engine.has_requests():
        engine.step()
    return sum(n for _, n in workload) / (time.perf_counter() - t0)
