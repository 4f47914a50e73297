"""CPU paged attention: the vectorised torch path against a naive per-request loop.

    .venv/bin/python benchmarks/engine/attention_cpu.py [--repeats 15]

Shapes are SmolLM2-135M's attention (9 query / 3 KV heads, head_dim 64), block size 16.
Workloads: 64 decode rows with 512 tokens of context each; a mixed step (4 prompt chunks of
128 tokens, two with 256 cached tokens before them, plus 60 decode rows of 512); and 64 decode
rows with contexts uniform in [32, 384] as in the W64 workload. Times are per layer, medians of
interleaved runs; the plan is built once per step and its cost is shown on its own.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.kernels import AttentionMetadata
from batchwire.kernels.paged_attention import paged_attention_reference
from batchwire.kernels.paged_attention_cpu import build_plan, paged_attention_torch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = rng.permutation(num_blocks)  # requests' blocks scattered over the cache
    table = np.zeros((len(seq_lens), max(blocks_per_req)), dtype=np.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n], used = order[used : used + n], used + n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = np.asarray(seq_lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),  # unused by attention
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    query = torch.randn(int(qsl[-1]), NUM_Q_HEADS, HEAD_DIM, dtype=dtype)
    return query, k_cache, v_cache, metadata


def naive_loop(query, k_cache, v_cache, metadata, scale):
    """What a first implementation does: per request, gather its K/V and call SDPA."""
    k_flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    v_flat = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    out = torch.empty_like(query)
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for r in range(len(seq_lens)):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        pos = torch.arange(seq_len)
        slots = metadata.block_table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = k_flat[slots].transpose(0, 1), v_flat[slots].transpose(0, 1)  # [nkv, seq_len, hd]
        q = query[start:end].transpose(0, 1)  # [nq, query_len, hd]
        # The cheapest SDPA form for each row: no mask for a decode row, is_causal for a fresh
        # prompt, an explicit mask only for a chunk after a cached prefix.
        mask, causal = None, end - start > 1 and seq_len == end - start
        if end - start > 1 and not causal:
            q_pos = torch.arange(seq_len - (end - start), seq_len)
            mask = pos[None, :] <= q_pos[:, None]  # [query_len, seq_len]
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=True,
        )  # fmt: skip  # 4-d: 3-d inputs take CPU SDPA's slow math path
        out[start:end] = o[0].transpose(0, 1)
    return out


def median_ms(fns: list, repeats: int) -> list[float]:
    """Median time of each function; runs interleave so load from other processes hits all."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            if i:  # the first round is warm-up
                samples.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def run(name: str, query_lens, seq_lens, dtype, repeats: int) -> None:
    query, k_cache, v_cache, metadata = make_step(query_lens, seq_lens, dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    want = paged_attention_reference(query, k_cache, v_cache, metadata, scale)
    got = paged_attention_torch(query, k_cache, v_cache, metadata, scale)
    err = (got.float() - want.float()).abs().max().item()

    plan_ms, fast_ms, naive_ms = median_ms(
        [
            lambda: build_plan(metadata, BLOCK_SIZE),
            lambda: paged_attention_torch(query, k_cache, v_cache, metadata, scale),
            lambda: naive_loop(query, k_cache, v_cache, metadata, scale),
        ],
        repeats,
    )
    dt = str(dtype).removeprefix("torch.")
    print(
        f"{name:<28} {dt:<9} plan {plan_ms:6.2f} ms | per layer: vectorised {fast_ms:7.2f} ms, "
        f"naive loop {naive_ms:7.2f} ms, ratio {naive_ms / fast_ms:5.1f}x | max err {err:.1e}"
    )


def timing_args(doc: str, repeats: int, threads: int) -> argparse.Namespace:
    """--repeats and --threads of an attention timing script; sets torch's threads."""
    parser = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=threads)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = timing_args(__doc__, 15, 2)
    torch.manual_seed(0)
    decode = ([1] * 64, [512] * 64)
    mixed = ([128] * 4 + [1] * 60, [128, 128, 384, 384] + [512] * 60)
    w64 = ([1] * 64, np.random.default_rng(0).integers(32, 385, size=64).tolist())
    for dtype in (torch.bfloat16, torch.float32):
        run("decode 64 x 512", *decode, dtype, args.repeats)
        run("mixed 4x128 prefill + 60 dec", *mixed, dtype, args.repeats)
        run("decode 64 x [32, 384]", *w64, dtype, args.repeats)


if __name__ == "__main__":
    main()
