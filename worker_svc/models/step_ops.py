"""The layers' small ops in fewer dispatches on the torch path (CPU workers).

At one stream a decode step is 30 layers of ~1 token: each torch op costs microseconds of
dispatch whatever its size, and the norms, rotary and cache write were ~60 ops per layer. Here:
- what every layer would look up again (the rotary angles at this step's positions, whether the
  step writes every token's K/V) is looked up once per step, in `StepTables`;
- rotary turns q and k of a layer together, as one [T, q_heads + kv_heads, head_dim] view of the
  fused q|k|v output, in 6 ops: x * (cos, cos) + swap_halves(x) * (-sin, sin);
- RMSNorm (with its residual add) is torch's own rms_norm, one call;
- the K/V cache write finds the step's padding rows once, not once per layer.
Each gives the outputs of the kernels' torch path (kernels/), bit for bit in float32 and in
bfloat16 (the same float32 arithmetic, rounded once); tests/worker/test_step_ops.py holds them
to it. The Triton path (CUDA) keeps the kernels: StepTables.fused is False there.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from batchwire import kernels
from batchwire.kernels.backend import use_triton


@dataclasses.dataclass(slots=True)
class StepTables:
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [max_position, rotary_dim] float32, the model's whole table
    # [T, 1, head_dim] float32: (cos, cos) and (-sin, sin) at each token's position; None where
    # the kernels serve (Triton, or a rotary_dim short of head_dim).
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # The cache slots this step writes and the token rows they come from (None: every row);
    # found by the first layer from the step's slot mapping (-1 = a padding row).
    slots: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    @classmethod
    def build(cls, positions: torch.Tensor, cos_sin: torch.Tensor, head_dim: int) -> StepTables:
        if use_triton(positions) or use_triton(cos_sin) or cos_sin.shape[1] != head_dim:
            return cls(positions, cos_sin)
        cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cls(positions, cos_sin, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))

    @property
    def fused(self) -> bool:
        return self.cos is not None

    def rotate(self, qk: torch.Tensor) -> None:
        """Rotates every head of qk [T, heads, head_dim] in place, neox style (the halves of
        head_dim are the pairs). Needs `fused`."""
        assert self.cos is not None and self.sin is not None, "StepTables.fused is False"
        t, h, d = qk.shape
        x = qk.float()  # qk itself when float32: the products below are new tensors
        swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # (x2, x1)
        # x1 * cos - x2 * sin and x2 * cos + x1 * sin, as the kernel computes them: a - b and
        # a + (-b) are the same float.
        qk.copy_(x * self.cos + swapped * self.sin)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, nkv, hd]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, hd]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """kernels.reshape_and_cache, with the padding rows found once per step."""
        if not self.fused:
            kernels.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        if self.slots is None:
            valid = slot_mapping >= 0
            if bool(valid.all()):
                self.slots = slot_mapping
            else:
                self.rows = valid.nonzero().squeeze(1)
                self.slots = slot_mapping[self.rows]
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        if self.rows is not None:
            key, value = key[self.rows], value[self.rows]
        # The cache as [slots, nkv, hd]; a view also of the CPU head-major storage.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, self.slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, self.slots, value.to(v_cache.dtype))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kernels.rms_norm: norm(x) * weight; with residual, (norm(x + residual) * weight, the sum)."""
    if use_triton(x):
        return kernels.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = residual = x + residual  # rounded to x.dtype before the norm reads it, as unfused
    out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if residual is None else (out, residual)
