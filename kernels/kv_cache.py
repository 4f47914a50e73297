"""Allocation of a layer's paged K or V cache."""

import torch


def kv_cache_zeros(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:  # fmt: skip
    """A zeroed cache indexed [num_blocks, block_size, num_kv_heads, head_dim] on every device.

    On CPU its storage is head-major ([num_kv_heads, num_blocks, block_size, head_dim], seen
    through a permutation): the torch attention path then gathers whole blocks of one head,
    which its batched matmuls need contiguous. CUDA keeps the plain layout of the Triton kernels.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(
            num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
    storage = torch.zeros(
        num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device
    )
    return storage.permute(1, 2, 0, 3)
