"""Rotary position embeddings, neox style (the rotated half is the second half of rotary_dim)."""

import torch
from batchwire.kernels._checks import FLOAT_DTYPES, check_tensor
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.backend import use_triton


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cat(cos, sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rotary_dim features of every head of query and key, in place."""
    if use_triton(query):
        return rotary_embedding_triton(positions, query, key, cos_sin_cache)
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


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    NUM_HEADS_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    # cos, sin [1, HALF_P2] float32; rotates every head of one token in place.
    h = tl.arange(0, NUM_HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (h < num_heads) & (d < HALF)  # [NUM_HEADS_P2, HALF_P2]
    ptr1 = x_ptr + token * stride_t + h * stride_h + d
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF_P2)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)  # [1, HALF_P2]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)
    _rotate_heads(
        q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, Q_HEADS_P2, HALF_P2
    )
    _rotate_heads(
        k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, KV_HEADS_P2, HALF_P2
    )


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("positions", positions, 1, (torch.int64,), query.device, False)
    check_tensor("query", query, 3, FLOAT_DTYPES, query.device)
    check_tensor("key", key, 3, (query.dtype,), query.device)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,), query.device)
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > query.shape[2] or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"cos_sin_cache's rotary_dim {rotary_dim} must be even and fit head_dim: query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if query.shape[0] < num_tokens or key.shape[0] < num_tokens:
        raise ValueError(f"query/key have fewer tokens than positions ({num_tokens})")
    if num_tokens:
        half = rotary_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key,
            cos_sin_cache,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos_sin_cache.stride(0),
            query.shape[1],
            key.shape[1],
            HALF=half,
            HALF_P2=triton.next_power_of_2(half),
            Q_HEADS_P2=triton.next_power_of_2(query.shape[1]),
            KV_HEADS_P2=triton.next_power_of_2(key.shape[1]),
        )
    return query, key
