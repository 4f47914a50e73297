"""Rotary position embeddings, neox style (the rotated half is the second half of rotary_dim)."""

import torch


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cat(cos, sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rotary_dim features of every head of query and key, in place."""
    return rotary_embedding_torch(positions, query, key, cos_sin_cache)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # x [num_tokens, nh, head_dim]; cos, sin [num_tokens, 1, rotary_dim // 2] float32
    half = cos.shape[-1]
    x1 = x[..., :half].float()
    x2 = x[..., half : 2 * half].float()
    # Both halves are computed before either is written: for float32, x1 and x2 are views of x.
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    x[..., :half] = out1
    x[..., half : 2 * half] = out2


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)  # [num_tokens, rotary_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim // 2] each
    _rotate(query[:num_tokens], cos, sin)
    _rotate(key[:num_tokens], cos, sin)
    return query, key

