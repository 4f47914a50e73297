"""Per-batch sampling parameters as tensors, and the factory that builds them from requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch
from google.protobuf.message import Message

from worker_svc.sample.logits_processors import LogitShaping, ShapingParamsLike, build_logit_shaping

# Temperatures below this are greedy; dividing by them would overflow float32 logits.
GREEDY_EPS = 1e-5


@dataclasses.dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs for one batch; rebuilt only when batch membership changes."""

    temperature: torch.Tensor  # [num_reqs] float32; 0 = greedy row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs] float32; None when no row uses top-p (1.0 = off)
    top_k: torch.Tensor | None  # [num_reqs] int64; None when no row uses top-k (<= 0 = off)
    min_p: torch.Tensor | None  # [num_reqs] float32; None when no row uses it (0 = off)
    generators: dict[int, torch.Generator]  # row -> the request's own seeded generator
    no_penalties: bool
    presence_penalties: torch.Tensor  # [num_reqs] float32 (0 = off)
    frequency_penalties: torch.Tensor  # [num_reqs] float32 (0 = off)
    repetition_penalties: torch.Tensor  # [num_reqs] float32 (1 = off)
    # [num_reqs, max_prompt_len] int64 padded with vocab_size; only when penalties are on
    prompt_token_ids: torch.Tensor | None
    # Per row: the request's own output list, appended in place each step, so it stays
    # current between rebuilds.
    output_token_ids: list[list[int]]
    # row -> (min_tokens, ids masked while len(output) < min_tokens)
    min_tokens: dict[int, tuple[int, list[int]]]
    max_num_logprobs: int | None  # the largest top-n any row asked for; None = no row asked
    shaping: LogitShaping | None = None  # bias, allowed set, banned words; None = no row asks


class SamplingParamsLike(ShapingParamsLike, Protocol):
    """The fields of batchwire.v1.RequestSamplingParams; the protobuf message itself fits."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: Sequence[int]
    logprobs: int | None


def _logprobs_of(p: SamplingParamsLike) -> int | None:
    # proto3 `optional`: an unset field reads as 0, which would mean "sampled token only".
    if isinstance(p, Message):
        return p.logprobs if p.HasField("logprobs") else None
    return getattr(p, "logprobs", None)


def build_sampling_metadata(
    params: list[SamplingParamsLike],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Stack per-request params (one per row) into tensors; unused features become None.

    `output_token_ids` is kept by reference: the caller appends to the inner lists each step.
    Generators must live on `device`.
    """
    num_reqs = len(params)
    if len(output_token_ids) != num_reqs or len(prompt_token_ids) != num_reqs:
        raise ValueError(
            f"got {num_reqs} params, {len(output_token_ids)} output lists and "
            f"{len(prompt_token_ids)} prompts; need one of each per row"
        )

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)  # [num_reqs]

    temps = [max(float(p.temperature), 0.0) for p in params]
    # Out-of-range values count as off: proto3 sends an unset top_p as 0, not 1.
    top_ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    min_ps = [p.min_p if p.min_p > 0.0 else 0.0 for p in params]
    presence = [float(p.presence_penalty) for p in params]
    frequency = [float(p.frequency_penalty) for p in params]
    # proto3 default 0 would zero every logit's scale; treat it as off (1).
    repetition = [p.repetition_penalty if p.repetition_penalty > 0.0 else 1.0 for p in params]
    no_penalties = all(x == 0.0 for x in presence + frequency) and all(x == 1.0 for x in repetition)

    prompts = None
    if not no_penalties:
        max_len = max((len(t) for t in prompt_token_ids), default=0)
        padded = [list(t) + [vocab_size] * (max_len - len(t)) for t in prompt_token_ids]
        prompts = torch.tensor(padded, dtype=torch.int64, device=device).view(num_reqs, max_len)

    min_tokens: dict[int, tuple[int, list[int]]] = {}
    for row, p in enumerate(params):
        # An id outside the vocabulary can never be sampled, so it needs no mask.
        stop_ids = [t for t in p.stop_token_ids if 0 <= t < vocab_size]
        if p.min_tokens > 0 and stop_ids:
            min_tokens[row] = (p.min_tokens, stop_ids)
    asked = [n for n in map(_logprobs_of, params) if n is not None]

    return SamplingMetadata(
        temperature=f32(temps),
        all_greedy=all(t < GREEDY_EPS for t in temps),
        all_random=all(t >= GREEDY_EPS for t in temps),
        top_p=f32(top_ps) if any(p < 1.0 for p in top_ps) else None,
        top_k=(torch.tensor(top_ks, dtype=torch.int64, device=device) if any(top_ks) else None),
        min_p=f32(min_ps) if any(min_ps) else None,
        generators=generators,
        no_penalties=no_penalties,
        presence_penalties=f32(presence),
        frequency_penalties=f32(frequency),
        repetition_penalties=f32(repetition),
        prompt_token_ids=prompts,
        output_token_ids=output_token_ids,
        min_tokens=min_tokens,
        max_num_logprobs=max(asked) if asked else None,
        shaping=build_logit_shaping(params, vocab_size, device),
    )
