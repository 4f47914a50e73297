"""Verifies draft tokens against the target model's logits: 1 to d + 1 tokens per request.

Every logits row of a verifying step (see spec_decode_metadata) is sampled as the plain sampler
would sample that position had the drafts before it been the request's output: min_tokens and
penalties count those drafts, temperature, top-k, top-p and min-p shape the row's distribution,
and logprobs are the row's own. Call the token so drawn at row j the target token t_j.

A request keeps its drafts while each equals its position's target token, then keeps the target
token at the first mismatch, or the bonus row's when every draft matched: its output is t_0 ..
t_a for a accepted drafts.

- Greedy rows: t_j is the argmax, so drafts are accepted while they equal the argmax.
- Random rows: t_j is the exponential race argmax(p / q), q ~ Exp(1), over uniforms from the
  request's generator. The draft d_j is accepted when the race picks it, which happens with
  probability p(d_j); otherwise the race's winner is distributed as p with d_j removed and
  renormalised. That is the rejection rule for a one-hot draft distribution (the n-gram
  proposer's), so the output is distributed exactly as the target's.

Every row is sampled in one batched pass, the bonus row included; a request's bonus token is
kept, and its generator draws counted, only when every one of its drafts was accepted.

Seeds: each verified position draws exactly one row of vocab uniforms from the request's
generator, the row the plain sampler would draw for that token, and the generator is then wound
back to just after the rows of the tokens kept. A seeded request therefore emits the same tokens
with or without drafts, accepted or not, and its generator ends where one-by-one sampling would
have left it. Rows without a seed share the sampler's generator and promise nothing.

Constrained (grammar) requests carry no drafts: one bitmask row fits only the first position.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from worker_svc.sample.logits_processors import shaping_for_rows
from worker_svc.sample.sampler import LogprobsTensors, Sampler
from worker_svc.sample.sampling_metadata import SamplingMetadata
from worker_svc.spec_decode.metadata import SpecDecodeMetadata


@dataclasses.dataclass(slots=True)
class RejectionSamplerOutput:
    token_ids: list[list[int]]  # [num_reqs][1 .. d + 1]; [] for a discarded (mid-prefill) row
    num_accepted: np.ndarray  # [num_reqs] int64 drafts accepted (0 for a discarded row)
    first_logits_rows: np.ndarray  # [num_reqs] int64 logits row of each request's first token
    logprobs: LogprobsTensors | None  # [num_logits, 1 + n], rows as the logits; None = none asked


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its generator draws for the rows without a seed

    def __call__(
        self,
        logits: torch.Tensor,  # [num_logits, vocab] float32, grammar-masked; changed in place
        metadata: SamplingMetadata,  # per request, batch order
        spec: SpecDecodeMetadata,
        discard: np.ndarray,  # [num_reqs] bool: mid-prefill rows, whose token is dropped
    ) -> RejectionSamplerOutput:
        drafts = spec.drafts_per_request()
        per_position = per_position_metadata(metadata, spec, drafts)
        uniforms: torch.Tensor | None = None
        snapshots: dict[int, list[torch.Tensor]] = {}  # row -> generator state per kept count
        if not metadata.all_greedy:
            uniforms, snapshots = self._draw_uniforms(logits, metadata.generators, spec)
        sampled = self.sampler(logits, per_position, uniforms)
        target = sampled.sampled_token_ids  # [num_logits] int64

        num_accepted = count_accepted(target, spec)  # [num_reqs]
        num_accepted[discard] = 0
        num_kept = np.where(discard, 0, num_accepted + 1)  # [num_reqs]
        for row, states in snapshots.items():
            metadata.generators[row].set_state(states[num_kept[row]])

        first = spec.first_logits_rows  # [num_reqs]
        flat = target.tolist()
        token_ids = [
            flat[s : s + n] for s, n in zip(first.tolist(), num_kept.tolist(), strict=True)
        ]
        return RejectionSamplerOutput(token_ids, num_accepted, first, sampled.logprobs)

    def _draw_uniforms(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]
        generators: dict[int, torch.Generator],  # batch row -> the request's generator
        spec: SpecDecodeMetadata,
    ) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
        """One row of uniforms per logits row, a seeded request's drawn in position order from
        its generator; with each generator's state before its first row and after each row."""
        u = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        if len(generators) < len(spec.num_draft_tokens):
            u.uniform_(generator=self.sampler.generator)
        first, ends = spec.first_logits_rows, spec.cu_num_sampled_tokens
        snapshots: dict[int, list[torch.Tensor]] = {}
        for row, gen in generators.items():
            states = [gen.get_state()]
            for logits_row in range(int(first[row]), int(ends[row])):
                u[logits_row].uniform_(generator=gen)
                states.append(gen.get_state())
            snapshots[row] = states
        return u, snapshots


def count_accepted(target: torch.Tensor, spec: SpecDecodeMetadata) -> np.ndarray:
    """[num_reqs] int64: the length of each request's leading run of drafts equal to targets."""
    num_reqs = len(spec.num_draft_tokens)
    max_drafts = int(spec.num_draft_tokens.max()) if num_reqs else 0
    if max_drafts == 0:
        return np.zeros(num_reqs, dtype=np.int64)
    rows = torch.from_numpy(spec.target_logits_indices).to(target.device)
    match = (target[rows] == spec.draft_token_ids.to(target.device)).cpu().numpy()  # [drafts]
    grid = np.zeros((num_reqs, max_drafts), dtype=np.int64)  # [num_reqs, max_drafts], 0-padded
    grid[spec.draft_req_rows, spec.draft_positions] = match
    # The running product stays 1 up to the first mismatch (or the padding), 0 after it.
    return np.cumprod(grid, axis=1).sum(axis=1)


def per_position_metadata(
    metadata: SamplingMetadata, spec: SpecDecodeMetadata, drafts: list[list[int]]
) -> SamplingMetadata:
    """The batch's metadata with one row per logits row: row j of a request is the request as
    it would stand at that position, its drafts before j appended to its output."""
    rows = spec.logits_req_rows  # [num_logits] batch row of each logits row
    device = metadata.temperature.device
    index = torch.from_numpy(rows).to(device)

    def take(values: torch.Tensor) -> torch.Tensor:
        return values.index_select(0, index.to(values.device))

    def pick(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else take(values)

    outputs = metadata.output_token_ids
    # Only penalties and min_tokens read the output lists; skip the copies when neither is on.
    counts_outputs = not metadata.no_penalties or bool(metadata.min_tokens)
    positions = spec.logits_positions.tolist()
    expanded = [
        outputs[r] + drafts[r][:j] if counts_outputs and j else outputs[r]
        for r, j in zip(rows.tolist(), positions, strict=True)
    ]
    first = spec.first_logits_rows
    min_tokens = {
        int(first[r]) + j: setting
        for r, setting in metadata.min_tokens.items()
        for j in range(int(spec.num_draft_tokens[r]) + 1)
    }
    return dataclasses.replace(
        metadata,
        temperature=take(metadata.temperature),
        top_p=pick(metadata.top_p),
        top_k=pick(metadata.top_k),
        min_p=pick(metadata.min_p),
        generators={},  # the rejection sampler draws the uniforms itself
        presence_penalties=take(metadata.presence_penalties),
        frequency_penalties=take(metadata.frequency_penalties),
        repetition_penalties=take(metadata.repetition_penalties),
        prompt_token_ids=pick(metadata.prompt_token_ids),
        output_token_ids=expanded,
        min_tokens=min_tokens,
        # Bias, allowed set and banned words were laid out by batch row, the logits are not.
        shaping=None if metadata.shaping is None else shaping_for_rows(metadata.shaping, rows),
    )
