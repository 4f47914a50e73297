"""Split-KV paged attention for decode: each (request, KV head) also split over key ranges.

Few requests with long contexts would leave most SMs idle in the one-program-per-(request,
head) kernel; here each split writes a partial result and its log-sum-exp, and a second
kernel merges the splits.
"""

import torch
from batchwire.kernels._attention_tile import _attend_tile
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.attention_metadata import AttentionMetadata


@triton.jit
def _paged_decode_split_kernel(
    part_out_ptr,  # [num_reqs, num_q_heads, NUM_SPLITS, HEAD_DIM_P2] float32, normalised per split
    part_lse_ptr,  # [num_reqs, num_q_heads, NUM_SPLITS] float32, base-2 log-sum-exp per split
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    scale_log2,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Decode only (one query token per request): few requests with long contexts would leave
    # most SMs idle, so each (request, KV head) is also split over NUM_SPLITS key ranges.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)  # split 0 is never empty

    m = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + m
    row_ok = m < GROUP
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q_off = q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, start, hi, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
    empty = l_i == 0.0  # a split past the end of a short context
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = (req * num_q_heads + head).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(part_lse_ptr + part, lse, mask=row_ok)
    part_off = part[:, None] * HEAD_DIM_P2 + d[None, :]
    tl.store(part_out_ptr + part_off, acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_start:
        return
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    part = (req * num_q_heads + head).to(tl.int64) * NUM_SPLITS + s  # [SPLITS_P2]
    lse = tl.load(part_lse_ptr + part, mask=s < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits weigh 0
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM_P2 + d[None, :],
        mask=(s < NUM_SPLITS)[:, None],
        other=0.0,
    )  # [SPLITS_P2, HEAD_DIM_P2]
    o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_off = q_start.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_SM_COUNT: dict[torch.device, int] = {}


def num_kv_splits_for(
    query: torch.Tensor, num_reqs: int, num_kv_heads: int, max_seq_len: int
) -> int:
    """Enough splits to give the device about two programs per SM, each of >= 512 keys."""
    if not query.is_cuda:
        return 1
    if query.device not in _SM_COUNT:
        props = torch.cuda.get_device_properties(query.device)
        _SM_COUNT[query.device] = props.multi_processor_count
    wanted = triton.cdiv(2 * _SM_COUNT[query.device], max(1, num_reqs * num_kv_heads))
    splits = min(wanted, max_seq_len // 512, 64)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def launch_split_kv_decode(
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], written at each request's token
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale_log2: float,
    num_kv_splits: int,
    **constants,  # GROUP, HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, DOT_* and num_warps
) -> None:
    """Decode-only batches (every query_len is 1); the caller has checked the arguments."""
    num_reqs, num_q_heads = len(metadata.seq_lens_cpu), query.shape[1]
    parts = (num_reqs, num_q_heads, num_kv_splits)
    part_out = torch.empty(
        *parts, constants["HEAD_DIM_P2"], dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(*parts, dtype=torch.float32, device=query.device)
    bt, qsl = metadata.block_table, metadata.query_start_loc
    _paged_decode_split_kernel[(num_reqs, k_cache.shape[2], num_kv_splits)](
        part_out, part_lse, query, k_cache, v_cache, bt, metadata.seq_lens, qsl,
        scale_log2, num_q_heads, query.stride(0), query.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], bt.stride(0),
        NUM_SPLITS=num_kv_splits,
        BLOCK_M=max(16, triton.next_power_of_2(constants["GROUP"])),
        **constants,
    )  # fmt: skip
    _paged_decode_reduce_kernel[(num_reqs, num_q_heads)](
        out, part_out, part_lse, qsl, num_q_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_kv_splits,
        SPLITS_P2=triton.next_power_of_2(num_kv_splits),
        HEAD_DIM=constants["HEAD_DIM"],
        HEAD_DIM_P2=constants["HEAD_DIM_P2"],
    )  # fmt: skip
