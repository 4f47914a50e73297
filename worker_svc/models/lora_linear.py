"""LoRA deltas for a batch whose rows use different adapters (or none), in one pass per layer.

Each projection holds every slot's adapter at once. All slots' A matrices sit side by side in
one [in, slots * parts * rank] matrix, so shrinking every token against every slot is one
matmul; a per-token one-hot mask over slots (the step's, from the forward context) keeps each
token's own adapter and zeroes the rest, and one matmul per fused part (q|k|v: 3, gate|up: 2)
expands it with the B matrices stacked the same way. No Python loop runs over adapters or rows.

NOTE: the masked shrink costs max_loras * parts * max_rank multiply-adds per input feature and
token, whatever each token's adapter: cheap beside the base matmul for a few adapters of small
rank (4 x 16 on SmolLM2: ~15% of its projections), and a step with no adapter row skips it.
Many adapters would want a grouped kernel (tokens sorted by slot) instead.

A rank below max_rank is zero-padded, an empty slot is all zeros, and each adapter's B is
stored pre-multiplied by its scaling (lora_alpha / r), so the delta needs no per-slot factor.
"""

from __future__ import annotations

import torch
from batchwire.kernels.gemm_rows import in_row_buckets


class LoRAStack:
    """The adapters of one (possibly fused) projection, in every slot."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.in_features = in_features
        self.out_sizes = out_sizes  # one per fused part, in the fused output's order
        self.max_loras, self.max_rank = max_loras, max_rank
        parts = len(out_sizes)
        # [in, slots * parts * rank]: x @ a shrinks every token against every slot's A at once
        self.a = torch.zeros(in_features, max_loras * parts * max_rank, dtype=dtype, device=device)
        # per part: [slots * rank, out_part], scaling folded in
        self.b = [
            torch.zeros(max_loras * max_rank, out, dtype=dtype, device=device) for out in out_sizes
        ]

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter into `slot`: per part (A [r, in], scaled B [out, r]), or None for a
        part the adapter leaves alone."""
        a = self.a.view(self.in_features, self.max_loras, len(self.out_sizes), self.max_rank)
        a[:, slot].zero_()
        for j, weights in enumerate(parts):
            b = self.b[j].view(self.max_loras, self.max_rank, self.out_sizes[j])
            b[slot].zero_()
            if weights is None:
                continue
            lora_a, lora_b = weights
            rank = lora_a.shape[0]
            a[:, slot, j, :rank] = lora_a.t().to(a.dtype)
            b[slot, :rank] = lora_b.t().to(b.dtype)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """y (T, sum(out_sizes)) += each token's adapter's B A x; x (T, in); mask (T, slots) is
        1.0 at the token's slot, all zeros for a base-model token. Returns y."""
        num_tokens, parts = x.shape[0], len(self.out_sizes)
        # Rows in buckets, as the base layers': oneDNN keeps a kernel per shape it meets.
        shrunk = in_row_buckets(lambda rows: rows @ self.a, x).view(
            num_tokens, self.max_loras, parts, self.max_rank)
        shrunk = shrunk * mask[:, :, None, None]  # (T, slots, parts, rank): own slot only
        start = 0
        for j, out in enumerate(self.out_sizes):
            part = shrunk[:, :, j].reshape(num_tokens, self.max_loras * self.max_rank)
            y[:, start : start + out] += in_row_buckets(lambda rows, b=self.b[j]: rows @ b, part)
            start += out
        return y


def slot_mask(token_slots: torch.Tensor, max_loras: int, dtype: torch.dtype) -> torch.Tensor:
    """token_slots (T,) int64, -1 = the base model -> one-hot (T, max_loras) in dtype (a base
    token's row all zeros). The caller skips it when no token has an adapter (known on the host,
    so no device sync here)."""
    mask = torch.zeros(token_slots.shape[0], max_loras + 1, dtype=dtype, device=token_slots.device)
    # Column max_loras catches the base tokens' -1 and is dropped.
    mask.scatter_(1, torch.where(token_slots < 0, max_loras, token_slots).unsqueeze(1), 1.0)
    return mask[:, :max_loras]
