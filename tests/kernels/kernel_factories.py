"""Factories for kernel tests: a random paged batch, built as the runner builds them."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire.kernels import AttentionMetadata

# Absolute tolerance of attention outputs (values ~N(0, 1)) per dtype.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclasses.dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, nq, hd]
    key: torch.Tensor  # [num_tokens, nkv, hd]: this step's keys (already in the cache)
    value: torch.Tensor  # [num_tokens, nkv, hd]
    k_cache: torch.Tensor  # [num_blocks, block_size, nkv, hd]
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def make_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    num_padding_tokens: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> AttentionMetadata:
    """Requests with the given query and context lengths on randomly chosen cache blocks."""
    rng = np.random.default_rng(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 2
    assert sum(blocks_per_req) <= num_blocks, "not enough cache blocks for the batch"
    order = rng.permutation(num_blocks)
    # Rows hold garbage past their own blocks, including ids out of range, as a stale table does.
    table = rng.integers(-(10**6), 10**6, size=(len(seq_lens), max_blocks)).astype(np.int32)
    used = 0
    slots = []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        n = blocks_per_req[r]
        table[r, :n] = order[used : used + n]
        used += n
        pos = np.arange(s_len - q_len, s_len)
        slots.append(table[r, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    slots.append(np.full(num_padding_tokens, -1, dtype=np.int64))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = np.asarray(seq_lens, dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
    spare_blocks: int = 3,
    seed: int = 0,
    device: str = "cpu",
) -> PagedBatch:
    """A batch whose cache already holds every key/value up to each request's seq_len."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    metadata = make_metadata(
        query_lens, seq_lens, block_size, num_blocks, num_padding_tokens, seed, device
    )
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens) + num_padding_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    valid = metadata.slot_mapping >= 0
    slots = metadata.slot_mapping[valid]
    key = torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.zeros_like(key)
    key[valid] = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    value[valid] = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    query = randn(num_tokens, num_q_heads, head_dim)
    return PagedBatch(query, key, value, k_cache, v_cache, metadata)
