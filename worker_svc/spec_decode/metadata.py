"""The layout of a step that verifies draft tokens (speculative decoding).

A request with d drafts is scheduled 1 + d tokens: its last sampled token, then the drafts. The
hidden state at each of those positions predicts the token after it, so all 1 + d rows are
projected to logits: the first d verify the drafts (the target rows) and the last one gives the
token after the final draft (the bonus row), used only when every draft is accepted. A request
without drafts has one row, its last token's, which is its bonus row.

Worked through on [r0 decoding with 3 drafts, r1 prefilling 5 tokens, r2 decoding without]:
cu_num_scheduled [4, 9, 10] -> logits_indices [0, 1, 2, 3, 8, 9], target rows [0, 1, 2] (r0's
drafts), bonus rows [3, 4, 5] (one per request).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire.v1 import worker_pb2

from worker_svc.batch.input_batch import InputBatch


@dataclasses.dataclass(slots=True)
class SpecDecodeMetadata:
    num_draft_tokens: np.ndarray  # [num_reqs] int64 drafts per request, batch order; often 0
    cu_num_sampled_tokens: np.ndarray  # [num_reqs] int64 inclusive cumsum of drafts + 1
    draft_token_ids: torch.Tensor  # [num_drafts] int64 every request's drafts, batch order
    draft_req_rows: np.ndarray  # [num_drafts] int64 batch row of each draft's request
    draft_positions: np.ndarray  # [num_drafts] int64 index of each draft within its request
    logits_req_rows: np.ndarray  # [num_drafts + num_reqs] int64 batch row of each logits row
    logits_positions: np.ndarray  # [num_drafts + num_reqs] int64 verified position in request
    logits_indices: torch.Tensor  # [num_drafts + num_reqs] int64 hidden-state rows projected
    target_logits_indices: np.ndarray  # [num_drafts] int64 logits row that verifies each draft
    bonus_logits_indices: np.ndarray  # [num_reqs] int64 logits row after the last draft

    @property
    def num_sampled_tokens(self) -> np.ndarray:
        return self.num_draft_tokens + 1  # [num_reqs] logits rows per request

    @property
    def first_logits_rows(self) -> np.ndarray:
        return self.cu_num_sampled_tokens - self.num_sampled_tokens  # [num_reqs]

    def drafts_per_request(self) -> list[list[int]]:
        """Each request's draft ids, batch order ([] for most)."""
        flat = self.draft_token_ids.tolist()
        counts = self.num_draft_tokens.tolist()
        ends = np.cumsum(self.num_draft_tokens).tolist()
        return [flat[end - n : end] for end, n in zip(ends, counts, strict=True)]


def stage_draft_tokens(so: worker_pb2.SchedulerOutput, batch: InputBatch) -> np.ndarray | None:
    """Writes each request's drafts into its token row, just past its tokens, and returns the
    drafts per row ([num_reqs] int64); None when the step carries none.

    The request's token count is left alone: the drafts are only candidates. The input gather
    then reads them like any other scheduled token, and the tokens kept after verification
    overwrite them where they were rejected.
    """
    if not so.scheduled_spec_decode_tokens:
        return None
    num_drafts = np.zeros(batch.num_reqs, dtype=np.int64)  # [num_reqs]
    for entry in so.scheduled_spec_decode_tokens:
        row = batch.req_id_to_index[entry.req_id]
        start = int(batch.num_tokens_np[row])
        batch.token_ids_np[row, start : start + len(entry.ids)] = entry.ids
        num_drafts[row] = len(entry.ids)
    return num_drafts


def _arange_within(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: 0..counts[0]-1, 0..counts[1]-1, ... (the offset inside each segment)."""
    starts = np.cumsum(counts) - counts  # [len(counts)]
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


def build_spec_decode_metadata(
    num_draft_tokens: np.ndarray,  # [num_reqs] int64
    cu_num_scheduled_tokens: np.ndarray,  # [num_reqs] int64 inclusive cumsum of scheduled
    input_ids: torch.Tensor,  # [num_scheduled_tokens] the step's gathered token ids
) -> SpecDecodeMetadata:
    num_reqs = len(num_draft_tokens)
    num_sampled = num_draft_tokens + 1  # [num_reqs]
    cu_num_sampled = np.cumsum(num_sampled)  # [num_reqs]
    first_sampled = cu_num_sampled - num_sampled  # [num_reqs]
    rows = np.arange(num_reqs, dtype=np.int64)

    # A request's logits rows are its last 1 + d scheduled tokens.
    logits_positions = _arange_within(num_sampled)  # [num_logits]
    logits_req_rows = np.repeat(rows, num_sampled)  # [num_logits]
    logits_indices = np.repeat(cu_num_scheduled_tokens - num_sampled, num_sampled)
    logits_indices += logits_positions  # [num_logits]

    draft_positions = _arange_within(num_draft_tokens)  # [num_drafts]
    draft_req_rows = np.repeat(rows, num_draft_tokens)  # [num_drafts]
    target = np.repeat(first_sampled, num_draft_tokens) + draft_positions  # [num_drafts]
    # The token verified at logits row i is the input one position later: the draft itself.
    draft_token_ids = input_ids[torch.from_numpy(logits_indices[target + 1])].to(torch.int64)

    return SpecDecodeMetadata(
        num_draft_tokens=num_draft_tokens,
        cu_num_sampled_tokens=cu_num_sampled,
        draft_token_ids=draft_token_ids,
        draft_req_rows=draft_req_rows,
        draft_positions=draft_positions,
        logits_req_rows=logits_req_rows,
        logits_positions=logits_positions,
        logits_indices=torch.from_numpy(logits_indices),
        target_logits_indices=target,
        bonus_logits_indices=cu_num_sampled - 1,
    )
