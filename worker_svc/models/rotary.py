"""Rotary position embeddings: the cos/sin table, with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, interpolated, scaled)


def cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos over the first half, sin over the second."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()
