"""batchwire kernels: each entry point runs Triton on CUDA tensors and the torch path on CPU.

`set_backend("torch" | "triton" | "auto")` or env BATCHWIRE_KERNELS forces a choice.
"""

from batchwire.kernels.attention_metadata import AttentionMetadata
from batchwire.kernels.backend import get_backend, set_backend
from batchwire.kernels.paged_attention import paged_attention
from batchwire.kernels.reshape_and_cache import reshape_and_cache
from batchwire.kernels.rms_norm import rms_norm
from batchwire.kernels.rotary_embedding import rotary_embedding
from batchwire.kernels.token_bitmask import apply_token_bitmask

__all__ = [
    "AttentionMetadata",
    "apply_token_bitmask",
    "get_backend",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
]
