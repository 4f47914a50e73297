"""The batch-invariant attention's query tile: how many query positions share one gathered key
tile (`worker_svc/batch_invariant/attention.py`, QUERY_TILE), timed per layer.

    .venv/bin/python -m batchwire.benchmarks.engine.invariant_attention [--repeats 3]

QUERY_TILE 1 is each token attended alone (the first version of the mode). A prompt chunk's
tokens share each key tile read for their query tile; a decode token pays for the tile's other
rows. SmolLM2-135M's attention shapes (`attention_cpu.make_step`); runs interleave.
"""

from __future__ import annotations

import numpy as np
import torch
from batchwire.benchmarks.engine.attention_cpu import make_step, median_ms, timing_args

from worker_svc.batch_invariant import attention

TILES = (1, 4, 8, 16)


def timed(query_tile: int, step) -> torch.Tensor:
    query, k_cache, v_cache, metadata = step
    attention.QUERY_TILE = query_tile
    metadata.plan = None  # each size plans its own step, as the first layer of a step does
    return attention.paged_attention_invariant(query, k_cache, v_cache, metadata, 0.125)


def main() -> None:
    args = timing_args(__doc__, 3, 1)
    contexts = np.random.default_rng(0).integers(32, 385, size=64).tolist()
    cases = {"prefill 16 x 128": ([128] * 16, [128] * 16),
             "decode 64 x [32, 384]": ([1] * 64, contexts)}  # fmt: skip
    chosen = attention.QUERY_TILE
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for name, (query_lens, seq_lens) in cases.items():
                step = make_step(query_lens, seq_lens, dtype)
                ms = median_ms([lambda t=t, s=step: timed(t, s) for t in TILES], args.repeats)
                cells = "  ".join(f"tile {t}: {m:8.1f} ms" for t, m in zip(TILES, ms, strict=True))
                print(f"{str(dtype).removeprefix('torch.'):<9} {name:<22} {cells}", flush=True)
    finally:
        attention.QUERY_TILE = chosen


if __name__ == "__main__":
    main()
