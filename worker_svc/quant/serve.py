"""Puts quantized linear layers into a loaded model and says what it serves.

The loader hands over, per linear weight name, the `QuantizedWeight` a GGUF file stored (the
codes and scales as they are, after fusion); the mode (common/worker_config.py) decides:
  native (`auto` on bfloat16 CPU): Q4_0/Q4_1 -> int4 group 32, Q8_0 -> int8 per row, float
      weights stay bfloat16 (packed as before);
  int4: every linear weight int4 group 32 (GGUF Q4 codes as they are, float weights quantized
      here; Q8_0 as int8 per row: never fewer bits than the file stores);
  int8: every linear weight int8 per row.
Q8_0 keeps a scale per 32 columns, the int8 kernel one per row: its values are quantized again
per row (the LM head of a tied-embedding model: docs/performance.md gives what it costs). The
embedding lookup keeps the de-quantised table: it reads one row per token, not the matrix.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from worker_svc.quant.blocks import QuantizedWeight, block_fits, quantize_int4, quantize_int8_rows
from worker_svc.quant.kernel_table import choose
from worker_svc.quant.linear import QuantLinear


def kernels_available() -> bool:
    ops = torch.ops.aten
    names = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu",
             "_weight_int8pack_mm")
    return all(hasattr(ops, name) for name in names)


def install(model: nn.Module, mode: str, stored: dict[str, QuantizedWeight],
            dtype: torch.dtype, packs: bool) -> Counter[str]:
    """Replaces the model's nn.Linear layers as `mode` says; returns what each now serves
    ("Q4_1 as int4 group 32": count), for the description. packs: oneDNN can pack dtype
    weights on this CPU (models/packed_linear.packing_available); where it cannot (AVX2 only),
    large batches run a plain matmul of the de-quantised weight instead."""
    served: Counter[str] = Counter()
    for name, linear in list(_linears(model)):
        qweight = _weight_for(mode, stored.get(f"{name}.weight"), linear, name)
        if qweight is None:
            continue
        small = "int4" if qweight.bits == 4 else "int8"
        small_rows, large = choose(*qweight.shape)
        if large == "bf16" and not packs:
            large = "dense"
        layer = QuantLinear(qweight, dtype, small, large, small_rows, linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        kind = "int4 group 32" if small == "int4" else "int8 per row"
        served[f"{qweight.source} as {kind}"] += 1
    return served


def _weight_for(mode: str, stored: QuantizedWeight | None, linear: nn.Linear,
                name: str) -> QuantizedWeight | None:
    source = stored.source if stored is not None else str(linear.weight.dtype).removeprefix(
        "torch.")
    if mode == "native":
        return stored
    if mode == "int4":
        if stored is not None:  # Q4 as stored; Q8_0 as int8 (never fewer bits than the file's)
            return stored
        if not block_fits(linear.in_features):
            raise ValueError(f"quantization=int4: {name} has {linear.in_features} input "
                             "features, not a multiple of the group size 32")
        values = stored.dequantize() if stored is not None else linear.weight.detach()
        return quantize_int4(values, source)
    values = stored.dequantize() if stored is not None else linear.weight.detach()
    return quantize_int8_rows(values, source)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def describe(served: Counter[str], dtype: str) -> str:
    """What the quantized layers serve, for GetModelInfo.weights: e.g. "served as Q4_1 as int4
    group 32 x120 linear layers, Q8_0 as int8 per row x1; other weights and activations in
    bfloat16"; "" when none is quantized (the weights are then de-quantised to dtype)."""
    if not served:
        return ""
    layers = ", ".join(f"{kind} x{n}" for kind, n in sorted(served.items()))
    return f"linear layers: {layers}; other weights and activations in {dtype}"
