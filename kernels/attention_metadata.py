"""What the attention kernels need to know about one step's batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    # Tokens in this step; the tensors below may be padded past it.
    num_actual_tokens: int
    # [num_reqs + 1] int32 on the model's device: request i owns tokens [qsl[i], qsl[i + 1]).
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length after this step (computed + scheduled tokens).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32; entries past a request's seq_len may be garbage.
    block_table: torch.Tensor
    # [num_tokens] int64: cache slot of each token (block * block_size + offset); -1 = padding.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # [num_reqs + 1] int32 host copy, for planning the CPU path without reading the device.
    query_start_loc_cpu: np.ndarray
    # [num_reqs] int32 host copy.
    seq_lens_cpu: np.ndarray
    # The CPU path's per-step plan: built by the first layer, reused by the others.
    plan: object | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        """Every request schedules exactly one token (a step of decode rows, no prompt chunk)."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_reqs
