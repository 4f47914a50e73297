"""Step time with grammar bitmasks: a decode batch of 32 requests, half of them JSON-schema
constrained, against the same batch unconstrained, on the default model.

The worker runs in its own process (ZMQ by default), as in serving: get_grammar_bitmask runs on
the scheduler's CPU while the worker computes the forward pass, and costs a step only what it
does not hide. Printed: the median decode-step time of both batches, the median time inside
get_grammar_bitmask, and the overhead. Only steps where all 32 requests decode are counted.

    .venv/bin/python -m batchwire.benchmarks.offline.structured_output --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.llm import LLM

SCHEMA = {  # what the requests are asked to write; long enough not to end within --max-tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 32},
                           "city": {"type": "string", "maxLength": 24},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
    },
    "required": ["name", "age", "role", "address", "tags"],
}


class TimedBitmask:
    """Wraps Scheduler.get_grammar_bitmask: the seconds it took and the tokens of each step."""

    def __init__(self, scheduler: Any) -> None:
        self.inner = scheduler.get_grammar_bitmask
        self.calls: list[tuple[float, int]] = []  # (seconds, total scheduled tokens)
        scheduler.get_grammar_bitmask = self

    def __call__(self, so: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(so)
        self.calls.append((time.perf_counter() - t0, so.total_num_scheduled_tokens))
        return out


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
              timer: TimedBitmask) -> tuple[list[float], list[float]]:
    """(decode step seconds, get_grammar_bitmask seconds) of the steps where every request
    decodes one token."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(p, sp, request_id=f"r{i}")
    steps, masks = [], []
    while engine.has_requests():
        timer.calls.clear()
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if timer.calls and timer.calls[0][1] == len(prompts):
            steps.append(elapsed)
            masks.append(timer.calls[0][0])
    return steps, masks


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", default="zmq", choices=["uni", "zmq", "grpc"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the worker")
    args = ap.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the worker process
    torch.set_num_threads(args.threads)
    llm = LLM(executor_backend=args.transport, dtype=args.dtype, max_num_seqs=args.requests,
              max_num_batched_tokens=4096, max_model_len=512, kv_cache_memory_bytes=256 << 20,
              enable_prefix_caching=False)
    tok = llm.tokenizer
    texts = [tok.apply_chat_template(
        [{"role": "user", "content": f"Write the user record of employee number {i} as JSON."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.requests)]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            json_schema=json.dumps(SCHEMA))
    half = args.requests // 2
    batches = {"unconstrained": [free] * args.requests,
               "half constrained": [schema] * half + [free] * (args.requests - half)}
    timer = TimedBitmask(llm.engine.scheduler)
    try:
        run_batch(llm, prompts[:4], [free, free, schema, schema], timer)  # warm-up, compile
        steps: dict[str, list[float]] = {name: [] for name in batches}
        masks: list[float] = []
        for _ in range(args.rounds):  # interleaved, so a busy moment hits both alike
            for name, params in batches.items():
                s, m = run_batch(llm, prompts, params, timer)
                steps[name] += s
                if name == "half constrained":
                    masks += m
    finally:
        llm.shutdown()
    med = {name: statistics.median(s) * 1e3 for name, s in steps.items()}
    mask_ms = statistics.median(masks) * 1e3
    print(f"{args.requests} requests ({half} JSON-schema constrained), {args.transport} worker, "
          f"{args.dtype}, {args.threads} torch thread(s); medians over {args.rounds} rounds:")
    for name, s in steps.items():
        print(f"  {name:>16}: {med[name]:7.2f} ms per decode step ({len(s)} steps)")
    print(f"  get_grammar_bitmask: {mask_ms:7.3f} ms per step ({mask_ms / half * 1e3:.0f} us "
          f"per constrained row)")
    overhead = med["half constrained"] / med["unconstrained"] - 1
    print(f"  step-time overhead of the constraints: {overhead * 100:+.1f}%")


if __name__ == "__main__":
    main()
