"""Write each token's K and V into the paged KV cache at its slot."""

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (not written)
) -> None:
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

