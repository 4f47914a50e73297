"""Quantized weights as integer codes plus per-group scales, before any kernel packs them.

A `QuantizedWeight` holds w[n, k] = (codes[n, k] - offset) * scale[n, g] + zero[n, g] with
g = k // group, scales in float32. GGUF's block types map onto it without loss (their fp16
scales are exact in float32):
  Q4_0: w = d * (q - 8)   -> int4 codes q, scale d, zero 0
  Q4_1: w = d * q + m     -> int4 codes q, scale d, zero m + 8d  (torch's int4 kernels compute
                             (q - 8) * scale + zero, so the offset is 8 for every int4 weight)
  Q8_0: w = d * q         -> int8 codes q, scale d per 32 columns, zero 0
Rows stay rows, so the loader's row operations (llama.cpp's rotary permutation, the fusion of
q|k|v and gate|up) apply to codes and scales alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import numpy as np
import torch

GROUP = 32  # the block size of GGUF's Q4_0, Q4_1 and Q8_0, and the int4 kernel's group size
INT4_OFFSET = 8

_Q = gguf.GGMLQuantizationType
NATIVE_KINDS = {_Q.Q4_0: "int4", _Q.Q4_1: "int4", _Q.Q8_0: "int8"}


@dataclasses.dataclass
class QuantizedWeight:
    bits: int  # 4 or 8
    codes: torch.Tensor  # [N, K]: uint8 in [0, 15] (int4) or int8 (int8)
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    group: int
    source: str  # what the codes came from: "Q4_1", "Q8_0", "bfloat16 at load", ...

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes and scales stand for."""
        offset = INT4_OFFSET if self.bits == 4 else 0
        scale = self.scale.repeat_interleave(self.group, dim=1)
        zero = self.zero.repeat_interleave(self.group, dim=1)
        return (self.codes.float() - offset) * scale + zero

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with fn (a row permutation or selection) applied to every part."""
        return dataclasses.replace(
            self, codes=fn(self.codes), scale=fn(self.scale), zero=fn(self.zero)
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        first = parts[0]
        if any((p.bits, p.group) != (first.bits, first.group) for p in parts):
            raise ValueError("fused projections are stored in different quantized types")
        sources = sorted({p.source for p in parts})
        return dataclasses.replace(
            first,
            codes=torch.cat([p.codes for p in parts]),
            scale=torch.cat([p.scale for p in parts]),
            zero=torch.cat([p.zero for p in parts]),
            source="+".join(sources),
        )


def from_gguf_blocks(data: np.ndarray, kind: int) -> QuantizedWeight:
    """Codes and scales of a Q4_0, Q4_1 or Q8_0 tensor; data is its rows of bytes."""
    kind = _Q(kind)
    rows = data.shape[0]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, type_size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == _Q.Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return _weight(8, codes, d, np.zeros_like(d), kind.name)
    packed = blocks[..., 4:] if kind == _Q.Q4_1 else blocks[..., 2:]
    # Each byte holds element j in its low nibble and element j + 16 in its high nibble.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if kind == _Q.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + INT4_OFFSET * d
    else:
        zero = np.zeros_like(d)
    return _weight(4, codes, d, zero, kind.name)


def _weight(bits: int, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray,
            source: str) -> QuantizedWeight:
    assert block_fits(codes.shape[1])
    return QuantizedWeight(bits, torch.from_numpy(np.ascontiguousarray(codes)),
                           torch.from_numpy(scale), torch.from_numpy(zero), GROUP, source)


def block_fits(in_features: int) -> bool:
    return in_features % GROUP == 0


def quantize_int4(weight: torch.Tensor, source: str) -> QuantizedWeight:
    """Asymmetric int4 per group of 32 columns (min to max in 16 steps), from a float weight."""
    w = weight.float().reshape(weight.shape[0], -1, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(4, codes.reshape(weight.shape), scale, low + INT4_OFFSET * scale,
                           GROUP, source)


def quantize_int8_rows(weight: torch.Tensor, source: str) -> QuantizedWeight:
    """Symmetric int8 with one scale per row (what the int8 weight-only kernel takes)."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, codes, scale[:, None], torch.zeros_like(scale[:, None]),
                           w.shape[1], source)
