"""A step of prompt chunks through the model's forward, the native step's `between` (torch's
products, the rest of each layer in C, each prompt token attending on its own) against the torch
path, in one process, in turns: the evidence for decoder.py's PROMPT_CONTEXT_LIMIT.

    .venv/bin/python -m batchwire.benchmarks.offline.prefill_paths --prompts 128,256,384,2048,8x256
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid


def prefill_metadata(lengths: list[int], block_size: int) -> object:
    from batchwire.kernels import AttentionMetadata

    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq = np.array(lengths, dtype=np.int32)
    width = -(-max(lengths) // block_size)
    table = np.arange(1, len(lengths) * width + 1, dtype=np.int32).reshape(len(lengths), width)
    slots = np.concatenate([table[r, np.arange(n) // block_size] * block_size +
                            np.arange(n) % block_size for r, n in enumerate(lengths)])
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)), max_query_len=max(lengths),
        max_seq_len=max(lengths), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )  # fmt: skip


def parse_prompts(spec: str) -> list[int]:
    """"256" -> [256]; "8x256" -> eight prompts of 256 tokens."""
    count, _, length = spec.rpartition("x")
    return [int(length)] * int(count or 1)


def one_step(model, path: str, ids: torch.Tensor, positions: torch.Tensor,
             metadata: object) -> None:
    """One forward of the step on `path`: between() called directly (the model's forward sends
    prompts past PROMPT_CONTEXT_LIMIT to the torch path), or the torch path."""
    native = model.native
    if path == "between":
        native.between(model._embed(ids), positions, metadata)
        return
    model.native = None
    try:
        model(ids, positions)
    finally:
        model.native = native


def main() -> None:
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.models.forward_context import set_forward_context
    from worker_svc.runner.worker import Worker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--prompts", default="128,256,384,2048,8x256",
                        help="steps, comma list: a prompt length, or COUNTxLENGTH prompts")
    parser.add_argument("--rounds", type=int, default=3, help="turns of both paths per step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = [parse_prompts(s) for s in args.prompts.split(",")]
    longest = max(sum(s) for s in steps)
    worker = Worker(WorkerConfig(kv_cache_memory_bytes=1 << 30, max_num_reqs=16,
                                 max_model_len=max(max(s) for s in steps) + 16,
                                 max_num_batched_tokens=longest))
    model, native = worker.model, worker.model.native
    if native is None:
        raise SystemExit("no native step here (see the worker's log line for why)")
    print(f"prefill steps, {args.threads} threads; medians of {args.rounds} rounds (ms)")
    for spec, lengths in zip(args.prompts.split(","), steps, strict=True):
        metadata = prefill_metadata(lengths, worker.config.block_size)
        ids = torch.randint(100, 10_000, (sum(lengths),))
        positions = torch.cat([torch.arange(n) for n in lengths])
        times: dict[str, list[float]] = {"between": [], "torch": []}
        with torch.inference_mode(), set_forward_context(metadata):
            for name in times:  # warm-up
                one_step(model, name, ids, positions, metadata)
            for _ in range(args.rounds):
                for name in times:
                    start = time.perf_counter()
                    one_step(model, name, ids, positions, metadata)
                    times[name].append((time.perf_counter() - start) * 1e3)
        b, t = statistics.median(times["between"]), statistics.median(times["torch"])
        print(f"  {spec} tokens: between {b:.0f} ms, torch {t:.0f} ms, between {t / b:.2f}x as "
              f"fast")


if __name__ == "__main__":
    main()
