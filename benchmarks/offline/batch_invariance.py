"""How often a greedy request's answer changes with the batch around it, batch-invariant mode off
and on, on one in-process engine each.

The first --requests prompts of W64 each run alone, then all 64 W64 prompts run together (every
output capped at --max-tokens, EOS ignored, greedy, the sampled token's logprob asked for): a
request counts as changed when its tokens (or, stricter, its logprobs, bit for bit) together
differ from its own alone. Prefix caching is off, so the batched run recomputes every prompt.

    .venv/bin/python -m batchwire.benchmarks.offline.batch_invariance --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.workloads import w64

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.llm import LLM


def compare(batch_invariant: bool, dtype: str, num_requests: int, max_tokens: int) -> str:
    prompts = [{"prompt_token_ids": p} for p, _ in w64()]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    llm = LLM(dtype=dtype, batch_invariant=batch_invariant, enable_prefix_caching=False,
              max_num_seqs=64, kv_cache_memory_bytes=512 << 20)
    try:
        start = time.perf_counter()
        alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts[:num_requests]]
        together = llm.generate(prompts, params, use_tqdm=False)[:num_requests]
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(a.token_ids != b.token_ids for a, b in zip(alone, together, strict=True))
    logprobs = sum(a.logprobs != b.logprobs for a, b in zip(alone, together, strict=True))
    mode = "on " if batch_invariant else "off"
    return (f"{dtype} batch-invariant {mode}: of {num_requests} greedy requests, {tokens} gave "
            f"other tokens and {logprobs} other logprobs beside 63 others than alone "
            f"({seconds:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--requests", type=int, default=16, help="W64 prompts also run alone")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--modes", default="off,on", help="batch-invariant mode off, on or both")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        print(compare(mode == "on", args.dtype, args.requests, args.max_tokens), flush=True)


if __name__ == "__main__":
    main()
