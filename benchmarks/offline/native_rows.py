"""A decode step of R rows (one new token per request) through the model's forward and LM head,
the native CPU step against the torch path, in one process, in turns: what `--cpu-decode`
chooses between, and the evidence for the native step's limit of 8 rows.

    .venv/bin/python -m batchwire.benchmarks.offline.native_rows --rows 1,2,4,8 --context 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid


def decode_metadata(rows: int, position: int, block_size: int, blocks_per_row: int) -> object:
    from batchwire.kernels import AttentionMetadata

    table = np.arange(1, rows * blocks_per_row + 1, dtype=np.int32).reshape(rows, -1)
    qsl = np.arange(rows + 1, dtype=np.int32)
    seq = np.full(rows, position + 1, dtype=np.int32)
    slots = table[:, position // block_size].astype(np.int64) * block_size + (
        position % block_size)
    return AttentionMetadata(
        num_actual_tokens=rows, query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots), max_query_len=1, max_seq_len=position + 1,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )  # fmt: skip


def main() -> None:
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.models.forward_context import set_forward_context
    from worker_svc.runner.worker import Worker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--rows", default="1,2,4,8", help="decode rows per step, comma list")
    parser.add_argument("--context", type=int, default=128, help="tokens each row attends to")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="turns of both paths per row count")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    worker = Worker(WorkerConfig(kv_cache_memory_bytes=256 << 20, max_num_reqs=8,
                                 max_model_len=args.context + 16))
    model, native = worker.model, worker.model.native
    if native is None:
        raise SystemExit("no native step here (see the worker's log line for why)")
    # The torch path as --cpu-decode torch runs it: its own attention kernel too.
    layers = model.attention_layers()
    kernels = {"native": [a.attend for a in layers],
               "torch": [getattr(a.attend, "fallback", a.attend) for a in layers]}
    block = worker.config.block_size
    position = args.context - 1
    print(f"decode steps at context {args.context}, {args.threads} threads; medians of "
          f"{args.rounds} rounds of {args.steps} steps (ms per step)")
    for rows in (int(r) for r in args.rows.split(",")):
        metadata = decode_metadata(rows, position, block, -(-(args.context + 16) // block))
        ids, positions = torch.arange(rows) + 100, torch.full((rows,), position)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        with torch.inference_mode(), set_forward_context(metadata):
            for _ in range(args.rounds):
                for name, path in (("native", native), ("torch", None)):
                    model.native = path
                    for attention, kernel in zip(layers, kernels[name], strict=True):
                        attention.attend = kernel
                    model.compute_logits(model(ids, positions))  # warm-up
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        model.compute_logits(model(ids, positions))
                    times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        model.native = native
        for attention, kernel in zip(layers, kernels["native"], strict=True):
            attention.attend = kernel
        n, t = statistics.median(times["native"]), statistics.median(times["torch"])
        print(f"  {rows} rows: native {n:.1f} ms, torch {t:.1f} ms, native {t / n:.2f}x as "
              f"fast (rounds: native {', '.join(f'{x:.1f}' for x in times['native'])}; torch "
              f"{', '.join(f'{x:.1f}' for x in times['torch'])})")


if __name__ == "__main__":
    main()
