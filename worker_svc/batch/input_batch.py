"""The persistent batch: one preallocated row per running request, diffed each step, never rebuilt.

A request id is stable across steps; its row index is not (condense() moves rows into holes).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import torch
from batchwire.v1 import worker_pb2

from worker_svc.batch.block_table import BlockTable
from worker_svc.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata


@dataclasses.dataclass(slots=True)
class CachedRequestState:
    """What the runner knows of a request; outlives its row in the batch (e.g. while preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: worker_pb2.RequestSamplingParams
    generator: torch.Generator | None  # the request's own, when it brought a seed
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter it runs with; 0 = the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_reqs  # [rows]
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs  # [rows]
        self.token_ids_np = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)  # [rows, len]
        self.token_ids = torch.from_numpy(self.token_ids_np)
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)  # [rows] prompt + output
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)  # [rows]
        self.lora_ids_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows] adapter id, 0 = base
        self.block_table = BlockTable(
            max_num_reqs, -(-max_model_len // block_size), block_size, max_num_batched_tokens,
            device,
        )  # fmt: skip
        self._holes: list[int] = []  # free rows below num_rows, ascending
        self.num_rows = 0  # one past the highest occupied row (holes included)
        self._sampling_metadata: SamplingMetadata | None = None  # None = membership changed

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Puts the request in the lowest free row and returns that row."""
        if self._holes:
            row = self._holes.pop(0)
        else:
            row = self.num_rows
            if row >= self.max_num_reqs:
                raise RuntimeError(f"the batch is full ({self.max_num_reqs} rows)")
            self.num_rows += 1
        n_prompt, n_total = len(state.prompt_token_ids), state.num_tokens
        self.token_ids_np[row, :n_prompt] = state.prompt_token_ids
        self.token_ids_np[row, n_prompt:n_total] = state.output_token_ids
        self.num_tokens_np[row] = n_total
        self.num_computed_tokens_np[row] = state.num_computed_tokens
        self.lora_ids_np[row] = state.lora_id
        self.block_table.add_row(state.block_ids, row)
        self.req_ids[row] = state.req_id
        self.states[row] = state
        self.req_id_to_index[state.req_id] = row
        self._sampling_metadata = None
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Frees the request's row, leaving a hole for condense(); None if it had no row."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        assert state is not None
        state.num_computed_tokens = int(self.num_computed_tokens_np[row])  # the row was the truth
        self.req_ids[row] = None
        self.states[row] = None
        self.lora_ids_np[row] = 0
        bisect.insort(self._holes, row)
        self._sampling_metadata = None
        return row

    def condense(self) -> None:
        """Moves the highest occupied rows into the lowest holes so rows 0..num_reqs-1 are dense."""
        num_reqs = self.num_reqs
        holes = [h for h in self._holes if h < num_reqs]
        # As many occupied rows lie at or above num_reqs as there are holes below it.
        movers = [r for r in range(num_reqs, self.num_rows) if self.req_ids[r] is not None]
        for hole, src in zip(holes, reversed(movers), strict=True):
            self._move_row(src, hole)
        self._holes.clear()
        self.num_rows = num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens_np[src])
        self.token_ids_np[dst, :n] = self.token_ids_np[src, :n]
        self.num_tokens_np[dst] = n
        self.num_computed_tokens_np[dst] = self.num_computed_tokens_np[src]
        self.lora_ids_np[dst], self.lora_ids_np[src] = self.lora_ids_np[src], 0
        self.block_table.move_row(src, dst)
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.states[dst] = req_id, self.states[src]
        self.req_ids[src], self.states[src] = None, None
        self.req_id_to_index[req_id] = dst
        self._sampling_metadata = None

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens_np[row])
        self.token_ids_np[row, n] = token_id
        self.num_tokens_np[row] = n + 1

    @property
    def sampling_metadata(self) -> SamplingMetadata:
        """Rebuilt only after membership changed; the output lists inside grow in place."""
        if self._sampling_metadata is None:
            states = [s for s in self.states[: self.num_reqs] if s is not None]
            self._sampling_metadata = build_sampling_metadata(
                [s.sampling for s in states],
                [s.output_token_ids for s in states],
                [s.prompt_token_ids for s in states],
                {row: s.generator for row, s in enumerate(states) if s.generator is not None},
                self.vocab_size,
                self.device,
            )
        return self._sampling_metadata
