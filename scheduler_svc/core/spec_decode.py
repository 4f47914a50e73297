"""Speculative decoding, the scheduler's side: which requests get drafts, how many, and what a
verified step changes.

Each step, a running request about to decode (all its tokens but the last computed) gets up to
K draft tokens from the n-gram proposer and is scheduled 1 + d tokens: its last token, then the
drafts, verified by the worker in one forward pass. It gets back 1 to d + 1 tokens. Requests get
no drafts when they are still prefilling (the step computes prompt tokens, whose next tokens are
known), carry a structured-output constraint (one grammar bitmask row fits only the first
position, and the matcher cannot be advanced over tokens not yet accepted), or have no room left
(max_tokens or max_model_len one token away).

schedule() advances num_computed_tokens by the tokens scheduled; a verified step corrects it by
the rejected drafts, whose KV is overwritten later. Their blocks stay with the request and are
filled by the next steps' tokens.
"""

from __future__ import annotations

import numpy as np
from batchwire.v1 import worker_pb2

from scheduler_svc.core.block_pool import KVCacheBlock
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.ngram_proposer import NgramProposer
from scheduler_svc.core.outputs import TokenLogprobs
from scheduler_svc.core.request import Request

_NO_DRAFTS = np.zeros(0, dtype=np.int32)


class _TokenBuffer:
    """A request's prompt + output as a growing int32 array: converting a 1-2k token Python list
    to numpy each step would cost several times the proposal itself."""

    __slots__ = ("array", "length")

    def __init__(self) -> None:
        self.array = np.zeros(256, dtype=np.int32)  # [capacity]
        self.length = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens)]: the view after appending what tokens gained since the last call."""
        n = len(tokens)
        if n > self.array.shape[0]:
            grown = np.zeros(max(n, 2 * self.array.shape[0]), dtype=np.int32)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length : n] = tokens[self.length :]
        self.length = n
        return self.array[:n]


class SpecDecoder:
    """Proposes each step's drafts and reads back each verified step's outcome."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int,
                 max_model_len: int) -> None:
        self.proposer = NgramProposer(num_speculative_tokens, min_n, max_n)
        self.max_model_len = max_model_len
        self._buffers: dict[str, _TokenBuffer] = {}  # wire id -> the request's tokens

    @property
    def k(self) -> int:
        return self.proposer.num_speculative_tokens

    def propose(self, request: Request, budget: int) -> np.ndarray:
        """[d] int32 drafts for a running request about to decode, d <= budget; empty when it
        gets none."""
        num_tokens = len(request.all_token_ids)
        # At most max_tokens (and below max_model_len, the worker's rule) after all d + 1 kept.
        room = min(self.k, budget,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - num_tokens - 1)
        if room < 1 or request.grammar is not None or request.sampling_params.constraint:
            return _NO_DRAFTS
        buffer = self._buffers.get(request.wire_id)
        if buffer is None:
            buffer = self._buffers[request.wire_id] = _TokenBuffer()
        drafts = self.proposer.propose(buffer.sync(request.all_token_ids))
        return drafts[:room]

    def allocate_with_drafts(self, kv: KVCacheManager, request: Request, budget: int
                             ) -> tuple[list[KVCacheBlock] | None, np.ndarray]:
        """Drafts for a decoding request and KV slots for its 1 + d tokens within `budget`:
        (the new blocks, [d] drafts), or (None, no drafts) when it gets none or the pool is
        short of them, and the caller schedules its one token as without speculation (so
        speculation never preempts a request)."""
        drafts = self.propose(request, budget - 1)
        if not drafts.size:
            return None, drafts
        new_blocks = kv.allocate_slots(request, 1 + drafts.size)
        return (None, _NO_DRAFTS) if new_blocks is None else (new_blocks, drafts)

    def forget(self, request: Request) -> None:
        self._buffers.pop(request.wire_id, None)


def add_drafts(so: worker_pb2.SchedulerOutput, drafts: dict[str, np.ndarray]) -> None:
    """One scheduled_spec_decode_tokens entry per request with drafts (never an empty one)."""
    add = so.scheduled_spec_decode_tokens.add
    for req_id, ids in drafts.items():
        add(req_id=req_id, ids=ids.tolist())


def draft_counts(so: worker_pb2.SchedulerOutput) -> dict[str, int]:
    """Wire id -> drafts that step `so` carried for it."""
    return {e.req_id: len(e.ids) for e in so.scheduled_spec_decode_tokens}


def read_logprobs(model_output: worker_pb2.ModelRunnerOutput, index: int, with_drafts: bool,
                  num_kept: int) -> list[TokenLogprobs] | None:
    """The logprobs of request `index`'s first num_kept tokens; None where none were asked.

    A step that carried drafts sends one entry per kept token (token_logprobs), others one
    entry per request (logprobs)."""
    if with_drafts:
        if not model_output.token_logprobs:
            return None
        positions = model_output.token_logprobs[index].positions[:num_kept]
        return [TokenLogprobs(list(p.token_ids), list(p.logprobs), p.sampled_token_rank)
                for p in positions] or None
    if not model_output.logprobs or not model_output.logprobs[index].token_ids:
        return None
    lp = model_output.logprobs[index]
    return [TokenLogprobs(list(lp.token_ids), list(lp.logprobs), lp.sampled_token_rank)]
