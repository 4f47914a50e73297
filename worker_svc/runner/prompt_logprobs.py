"""Logprobs of a request's prompt tokens, computed chunk by chunk as its prefill runs.

A position p of the prompt predicts the token at p + 1, so a chunk covering positions [c, c + s)
yields the logprobs of prompt tokens c + 1 .. c + s (the last chunk stops at the prompt's end),
and the chunks together cover every prompt token after the first. The logits of those positions
are computed from the forward pass's hidden states, which only the last position's row needs
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from batchwire.v1 import worker_pb2

from worker_svc.batch.input_batch import CachedRequestState


def compute_prompt_logprobs(
    hidden: torch.Tensor,  # [num_tokens, hidden] this step's hidden states, batch order
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    states: Sequence[CachedRequestState | None],  # [num_reqs] by row
    num_computed: np.ndarray,  # [num_reqs] computed tokens before this step
    num_scheduled: np.ndarray,  # [num_reqs] tokens computed this step
) -> dict[int, worker_pb2.PromptLogprobs]:
    """row -> the logprobs of the prompt tokens this step's positions predict, for the rows
    whose request asked (sampling.prompt_logprobs) and still has prompt positions here."""
    out: dict[int, worker_pb2.PromptLogprobs] = {}
    starts = np.cumsum(num_scheduled) - num_scheduled  # [num_reqs] first token of each row
    for row, state in enumerate(states):
        if state is None or not state.sampling.HasField("prompt_logprobs"):
            continue
        first = int(num_computed[row])
        end = min(first + int(num_scheduled[row]), len(state.prompt_token_ids) - 1)
        if end <= first:
            continue  # decoding, or only the last prompt token (it predicts an output)
        start = int(starts[row])
        rows = hidden[start : start + end - first]  # [m, hidden], positions first .. end - 1
        logprobs = compute_logits(rows).float().log_softmax(dim=-1)  # [m, vocab]
        targets = torch.tensor(
            state.prompt_token_ids[first + 1 : end + 1], dtype=torch.int64, device=logprobs.device
        ).unsqueeze(1)  # [m, 1]
        out[row] = _entries(logprobs, targets, state.sampling.prompt_logprobs)
    return out


def _entries(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> worker_pb2.PromptLogprobs:
    target_lp = logprobs.gather(1, targets)  # [m, 1]
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)  # [m, k]
    ranks = (logprobs > target_lp).sum(dim=-1).add_(1).tolist()  # [m], ties share the better
    ids = torch.cat([targets, top_ids], dim=1).tolist()
    values = torch.cat([target_lp, top_lp], dim=1).tolist()
    msg = worker_pb2.PromptLogprobs()
    for token_ids, lps, rank in zip(ids, values, ranks, strict=True):
        msg.positions.add(token_ids=token_ids, logprobs=lps, sampled_token_rank=rank)
    return msg


def attach_prompt_logprobs(
    out: worker_pb2.ModelRunnerOutput, by_row: dict[int, worker_pb2.PromptLogprobs]
) -> None:
    """Adds the entries parallel to out.req_ids (rows are the batch's, in order)."""
    if not by_row:
        return
    for row in range(len(out.req_ids)):
        entry = out.prompt_logprobs.add()
        if row in by_row:
            entry.CopyFrom(by_row[row])
