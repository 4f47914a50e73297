"""Write each token's K and V into the paged KV cache at its slot."""

import torch
from batchwire.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.backend import use_triton


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (not written)
) -> None:
    if use_triton(key):
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, k_cache, v_cache, slot_mapping)


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens = slot_mapping.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, nkv, hd]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    key, value = key[:num_tokens], value[:num_tokens]
    valid = slot_mapping >= 0
    # NOTE: reading `valid` syncs on CUDA; this path serves CPU, where the check is cheap and
    # the common no-padding case then skips the gather of the token rows.
    if bool(valid.all()):
        slots = slot_mapping
    else:
        rows = valid.nonzero().squeeze(1)  # [num_valid]
        slots, key, value = slot_mapping[rows], key[rows], value[rows]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, NUM_HEADS_P2)[:, None]
    d = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)  # [NUM_HEADS_P2, HEAD_DIM_P2]
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + h * stride_kc_head
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + h * stride_vc_head
    tl.store(k_dst + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), k_cache.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), k_cache.device, False)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, 3, FLOAT_DTYPES, k_cache.device)
        if t.shape[0] < num_tokens or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected [>= {num_tokens} tokens, "
                f"{num_kv_heads}, {head_dim}] to match slot_mapping and the cache"
            )
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
    )
