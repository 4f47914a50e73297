"""The step's attention metadata (and LoRA slot mask), reached by the layers rather than passed as
arguments.

The runner installs them around the forward pass; the model's signature stays
(input_ids, positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from batchwire.kernels import AttentionMetadata

_current: AttentionMetadata | None = None
_lora_mask: torch.Tensor | None = None  # (T, max_loras) one-hot per token; None = no adapter


@contextlib.contextmanager
def set_forward_context(
    metadata: AttentionMetadata, lora_mask: torch.Tensor | None = None
) -> Iterator[None]:
    global _current, _lora_mask
    previous = _current, _lora_mask
    _current, _lora_mask = metadata, lora_mask
    try:
        yield
    finally:
        _current, _lora_mask = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers ran outside set_forward_context()")
    return _current


def get_lora_mask() -> torch.Tensor | None:
    """The step's per-token adapter slots (models/lora_linear.py slot_mask); None: base only."""
    return _lora_mask
