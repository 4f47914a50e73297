"""Paged attention over a mixed batch of prefill chunks and decode rows, one varlen launch."""

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_cpu import paged_attention_torch


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query token to its own request's keys, read through block tables.

    Returns [num_tokens, num_q_heads, head_dim] in query's dtype; padding rows are zero.
    """
    return paged_attention_torch(query, k_cache, v_cache, metadata, scale)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The obvious float32 loop over requests: the yardstick for the other paths."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for r in range(len(seq_lens)):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if end == start:
            continue
        pos = torch.arange(seq_len, device=query.device)  # [seq_len]
        slots = metadata.block_table[r, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [seq_len, nkv, hd]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [query_len, nq, hd]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [nq, query_len, seq_len]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out

