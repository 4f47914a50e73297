"""The inner step shared by the paged attention kernels: one tile of keys, online softmax."""

from batchwire.kernels._triton import tl, triton


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_DIM_P2]
    q_pos,  # [BLOCK_M] position of each query row; keys after it are masked
    m_i,  # [BLOCK_M] running max (base 2)
    l_i,  # [BLOCK_M] running sum
    acc,  # [BLOCK_M, HEAD_DIM_P2] float32
    start,
    kv_end,
    bt_row,
    k_base,
    v_base,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    n_ok = n < kv_end
    block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    k_off = block * stride_kb + (n % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
    v_off = block * stride_vb + (n % BLOCK_SIZE) * stride_vs
    k = tl.load(k_base + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_base + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc
