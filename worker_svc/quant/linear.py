"""A linear layer served from quantized weights, with the kernel picked per batch size.

Weight-only kernels (torch's CPU int4 group-wise and int8 per-row matmuls) read 2-4x fewer bytes
than bfloat16, and a decode step of a few rows is bound by reading weights, so they win there.
They de-quantise inside the kernel, which costs arithmetic: past a few dozen rows a plain
bfloat16 GEMM (oneDNN, weight packed once) or a dynamic int8 GEMM (fbgemm, int8 activations with
VNNI) is faster. Which one, and from how many rows, is a fixed table measured on this machine's
CPU (worker_svc/quant/kernel_table.py, benchmarks/engine/quant_kernels.py).
"""

from __future__ import annotations

import torch
from batchwire.kernels.gemm_rows import in_row_buckets
from torch import nn

from worker_svc.quant.blocks import QuantizedWeight, quantize_int8_rows

_BATCH_HINT = 64


def int4_pack(weight: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed int4 codes and its [K / group, N, 2] scales-and-zeros in dtype."""
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
    scales_zeros = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).to(dtype)
    return codes, scales_zeros.contiguous()


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                group: int) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) for a weight held as `QuantizedWeight`.

    small: "int4" or "int8" weight-only, used up to `small_rows` rows; large: "bf16" (oneDNN
    packed), "dense" (a plain matmul of the de-quantised weight in dtype: where oneDNN cannot
    pack, as on an AVX2-only CPU), "dyn8" (fbgemm dynamic int8) or the small kernel itself
    ("same") beyond."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, small: str, large: str,
                 small_rows: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        # The linear's own bias (q|k|v of Qwen2-family models), in the activations' dtype.
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.out_features, self.in_features = weight.shape
        self.small, self.large, self.small_rows = small, large, small_rows
        self.group = weight.group
        if small == "int4":
            if weight.bits != 4:
                raise ValueError(f"int4 kernel for a {weight.bits}-bit weight")
            self.int4, self.scales_zeros = int4_pack(weight, dtype)
        else:
            rows = weight if weight.group == self.in_features and weight.bits == 8 else (
                quantize_int8_rows(weight.dequantize(), weight.source))
            self.int8 = rows.codes
            self.int8_scale = rows.scale[:, 0].to(dtype).contiguous()
        if large == "bf16":  # as models/packed_linear.py, without keeping the plain weight
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.dequantize().to(dtype), _BATCH_HINT)
        elif large == "dense":
            self.weight = weight.dequantize().to(dtype)
        elif large == "dyn8":
            self.dense = _dynamic_int8(weight.dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.small_rows and self.large != "same":
            if self.large == "dyn8":
                y = self.dense(x2.float()).to(x.dtype)
            elif self.large == "dense":
                y = in_row_buckets(lambda x: torch.nn.functional.linear(x, self.weight), x2)
            else:  # rows in buckets: oneDNN keeps a kernel per shape (kernels/gemm_rows.py)
                y = in_row_buckets(lambda x: torch.ops.mkldnn._linear_pointwise(
                    x, self.packed, None, "none", [], ""), x2)
        elif self.small == "int4":
            y = int4_matmul(x2.contiguous(), self.int4, self.scales_zeros, self.group)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.int8, self.int8_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def _dynamic_int8(weight: torch.Tensor) -> nn.Module:
    """fbgemm's dynamic int8 linear (per-channel int8 weight, activations quantized per call)."""
    out_features, in_features = weight.shape
    layer = torch.ao.nn.quantized.dynamic.Linear(in_features, out_features, bias_=False,
                                                 dtype=torch.qint8)
    scale = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()
    qweight = torch.quantize_per_channel(weight, scale, torch.zeros(out_features, dtype=torch.long),
                                         0, torch.qint8)
    layer.set_weight_bias(qweight, None)
    return layer
