"""Paged attention over a mixed batch of prefill chunks and decode rows, one varlen launch."""

import math
import os

import torch
from batchwire.kernels._attention_tile import _attend_tile
from batchwire.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.attention_metadata import AttentionMetadata
from batchwire.kernels.backend import use_triton
from batchwire.kernels.paged_attention_cpu import paged_attention_torch
from batchwire.kernels.paged_attention_split_kv import launch_split_kv_decode, num_kv_splits_for


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
    if use_triton(query):
        return paged_attention_triton(query, k_cache, v_cache, metadata, scale)
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


@triton.jit
def _find_request(qsl_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    # Request r's query blocks are numbered from qsl[r] // BLOCK_Q + r: no host-side prefix sum
    # is needed, at the cost of at most one idle program per request. Binary search for r.
    # Built from program_id so both stay tensors even when num_reqs == 1 is specialised to a
    # constant: loop-carried values must keep one type.
    lo = q_block * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    scale_log2,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # One program: BLOCK_Q query tokens of one request x the GROUP query heads of one KV head,
    # flattened into BLOCK_M rows (row = token * GROUP + head), so K/V are read once per group.
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(qsl_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + req)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len  # keys already cached before this step's chunk

    m = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + m // GROUP  # [BLOCK_M] token index within the request
    head = kv_head * GROUP + m % GROUP  # [BLOCK_M] query head
    row_ok = (m < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    rows = (q_start + tok).to(tl.int64)
    q_off = rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prefix + tok
    # Keys past the tile's last query position are masked for every row: stop before them.
    kv_end = tl.minimum(seq_len, prefix + (local + 1) * BLOCK_Q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # Key 0 is in the first tile and visible to every row, so m_i is finite from then on.
    for start in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, start, kv_end, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
    acc = acc / l_i[:, None]
    o_off = rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    o_ok = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_kv_splits: int | None = None,  # decode-only batches; None = chosen from the shapes
) -> torch.Tensor:
    check_tensor("query", query, 3, FLOAT_DTYPES)
    device = query.device
    num_tokens, num_q_heads, head_dim = query.shape
    check_tensor("k_cache", k_cache, 4, (query.dtype,), device)
    check_tensor("v_cache", v_cache, 4, (query.dtype,), device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit the cache {tuple(k_cache.shape)}: head_dim "
            "must match and num_q_heads be a multiple of num_kv_heads"
        )
    num_reqs = len(metadata.seq_lens_cpu)
    check_tensor("block_table", metadata.block_table, 2, (torch.int32,), device)
    check_tensor("seq_lens", metadata.seq_lens, 1, (torch.int32,), device)
    check_tensor("query_start_loc", metadata.query_start_loc, 1, (torch.int32,), device)
    check_shape("seq_lens", metadata.seq_lens, (num_reqs,))
    check_shape("query_start_loc", metadata.query_start_loc, (num_reqs + 1,))

    out = torch.empty_like(query)
    if metadata.num_actual_tokens < num_tokens:
        out[metadata.num_actual_tokens :].zero_()
    if num_reqs == 0 or metadata.num_actual_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_dim_p2 = triton.next_power_of_2(head_dim)
    common = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_N=64 if head_dim_p2 <= 128 else 32,
        # float32 caches get exact float32 dots; tf32 would cost them ~3 decimal digits.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The Triton interpreter multiplies bfloat16 dot operands as their raw uint16 bits.
        DOT_IN_FP32=query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=4,
    )
    scale_log2 = scale * math.log2(math.e)  # softmax in base 2: exp2 is the fast instruction
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    bt, seq_lens, qsl = metadata.block_table, metadata.seq_lens, metadata.query_start_loc

    if metadata.max_query_len == 1:
        if num_kv_splits is None:
            num_kv_splits = num_kv_splits_for(query, num_reqs, num_kv_heads, metadata.max_seq_len)
        if num_kv_splits > 1:
            launch_split_kv_decode(
                out, query, k_cache, v_cache, metadata, scale_log2, num_kv_splits, **common
            )
            return out

    # Wide tiles pay off for prefill chunks; a decode row fills only GROUP rows of a tile.
    block_m = max(64 if metadata.max_query_len * group > 16 else 16, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, bt, seq_lens, qsl, scale_log2, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache_strides, bt.stride(0),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        **common,
    )  # fmt: skip
    return out
