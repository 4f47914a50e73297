"""Embeddings per second: LLM.embed (task "embed", last-token pooling, continuous batching with
no padding) against transformers' AutoModel on padded batches, same weights and dtype, same run.

256 inputs of random token ids (seed 0), lengths uniform in [32, 256]; the timed part is the
forward passes and pooling, model loading excluded. transformers pools the last real token of
each right-padded row and normalises it, as batchwire does.

    .venv/bin/python -m batchwire.benchmarks.offline.embeddings --dtype float32 \
        --hf-batch-sizes 32,64 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.workloads import HIGH_ID, LOW_ID


def inputs(n: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(LOW_ID, HIGH_ID) for _ in range(rng.randint(32, 256))]
            for _ in range(n)]


def run_batchwire(llm, batch: list[list[int]]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    vectors = llm.embed([{"prompt_token_ids": ids} for ids in batch])
    return time.perf_counter() - t0, torch.tensor(vectors)


def run_transformers(model, batch: list[list[int]], batch_size: int
                     ) -> tuple[float, torch.Tensor]:
    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(batch), batch_size):
            rows = batch[start:start + batch_size]
            lengths = torch.tensor([len(r) for r in rows])
            width = int(lengths.max())
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
            hidden = model(ids, attention_mask=mask).last_hidden_state  # (B, T, hidden)
            last = hidden[torch.arange(len(rows)), lengths - 1]
            out.append(F.normalize(last.float(), dim=1))
    return time.perf_counter() - t0, torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--hf-batch-sizes", default="32,64")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    from batchwire.common.model_files import resolve_model_path
    from transformers import AutoModel

    from scheduler_svc import LLM

    batch = inputs(args.num_inputs)
    llm = LLM(dtype=args.dtype, task="embed", pooling_type="last", max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=512 << 20, max_model_len=512)
    folder, name = os.path.split(resolve_model_path(None))
    hf = AutoModel.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, args.dtype)).eval()
    times: dict[str, list[float]] = {}
    ours = None
    for _ in range(args.repeats):
        seconds, ours = run_batchwire(llm, batch)
        times.setdefault("batchwire", []).append(seconds)
        for size in (int(s) for s in args.hf_batch_sizes.split(",")):
            seconds, ref = run_transformers(hf, batch, size)
            times.setdefault(f"transformers batch {size}", []).append(seconds)
    assert ours is not None
    cosine = float((ours * ref).sum(1).min())
    best = statistics.median(times["batchwire"])
    print(f"{len(batch)} inputs, {sum(map(len, batch))} tokens, dtype {args.dtype}, "
          f"torch threads {torch.get_num_threads()}; min cosine vs transformers {cosine:.6f}")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"{label:>24}: {len(batch) / median:7.1f} embeddings/s "
              f"(median of {len(values)}: {median:.1f} s; batchwire x{median / best:.2f})")
    llm.shutdown()


if __name__ == "__main__":
    main()
