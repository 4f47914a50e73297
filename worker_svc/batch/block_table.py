"""Each batch row's physical KV blocks, kept in place across steps; the per-token slot mapping."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.batch.staging import host_buffer


class BlockTable:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        max_num_tokens: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # Copied to the device each step: pinned there, like the runner's inputs (staging.py).
        self.table = host_buffer((max_num_reqs, max_num_blocks_per_req), torch.int32, device)
        self.table_np = self.table.numpy()  # [rows, blocks]; shares memory with table
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)  # [rows]
        self.slot_mapping = host_buffer(max_num_tokens, torch.int64, device)  # [tokens]
        self.slot_mapping_np = self.slot_mapping.numpy()

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replaces the row's blocks: a new request, or one resumed from preemption."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        self.table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.table_np[dst, :n] = self.table_np[src, :n]
        self.num_blocks_per_row[dst] = n

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """req_indices, positions: [tokens] -> slot of each token, block * block_size + offset."""
        num_tokens = len(positions)
        blocks = self.table_np[req_indices, positions // self.block_size]
        np.add(
            blocks * self.block_size,
            positions % self.block_size,
            out=self.slot_mapping_np[:num_tokens],
        )
        return self.slot_mapping[:num_tokens]

    def rows(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, max_blocks_per_req] view for the attention kernels."""
        return self.table[:num_reqs]
