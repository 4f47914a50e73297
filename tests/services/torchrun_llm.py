"""Run under torchrun by test_external_launcher.py: every rank builds the same LLM with the
external launcher, generates the same prompts, and writes its tokens to OUT/rank<RANK>.json.
argv: model, tensor_parallel_size, pipeline_parallel_size, out folder."""

from __future__ import annotations

import json
import os
import sys

import torch

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.llm import LLM

# Prompts longer than a step's token budget: their prefill comes in chunks.
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(20 + 17 * i)] for i in range(4)]
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=16, max_num_seqs=8,
              max_model_len=256, max_num_batched_tokens=32)


def sampling() -> list[SamplingParams]:
    """Greedy and seeded random sampling, alternately."""
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.9, top_p=0.9, seed=50 + i, max_tokens=12,
                           ignore_eos=True) for i in range(len(PROMPTS))]


def scaled_norm(worker, factor: float) -> float:
    """A collective_rpc: every rank changes its own weights (here the final norm, on the last
    stage), as a trainer loading new weights would; returns what this rank holds."""
    norm = worker.model.norm  # None on a stage before the last
    if norm is None:
        return 0.0
    with torch.no_grad():
        norm.weight.mul_(factor)
    return float(norm.weight.sum())


def main() -> None:
    model, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(model, executor_backend="external_launcher", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, **ENGINE)
    try:
        results = llm.generate(PROMPTS, sampling(), use_tqdm=False)
        held = llm.collective_rpc(scaled_norm, (1.0,))
    finally:
        llm.shutdown()
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"tokens": [r.token_ids for r in results], "rpc": held}, f)


if __name__ == "__main__":
    main()
