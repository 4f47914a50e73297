"""Turns one step's logits into token ids (and logprobs), vectorised over the batch's rows."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from worker_svc.sampling_metadata import GREEDY_EPS, SamplingMetadata


@dataclasses.dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [num_reqs, 1 + n] int64: sampled token, then top-n
    logprobs: torch.Tensor  # [num_reqs, 1 + n] float32
    sampled_rank: torch.Tensor  # [num_reqs] int64, 1 = most likely


@dataclasses.dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """min_tokens -> penalties -> greedy argmax, or temperature -> top-k/top-p -> min-p -> draw.

    Logprobs, when a row asks, are log_softmax of the logits as passed in (the raw model
    logits, after the caller's grammar mask), i.e. before penalties and temperature, as in
    vLLM. Rows that asked for fewer than `max_num_logprobs` get the same width; the caller trims.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Draws for rows without a seed of their own; None = torch's default generator.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [num_reqs, vocab] float32; modified in place.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [num_reqs, vocab]; a copy

        apply_min_tokens(logits, metadata)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)

        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)  # [num_reqs]
        else:
            sampled = self._sample_random(logits, metadata)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temp = metadata.temperature  # [num_reqs]
        greedy = None
        if not metadata.all_random:
            # Taken before temperature and masking, which cannot move a row's argmax anyway.
            greedy = logits.argmax(dim=-1)  # [num_reqs]
            temp = torch.where(temp < GREEDY_EPS, torch.ones_like(temp), temp)
        logits.div_(temp.unsqueeze(1))

        if metadata.top_k is not None or metadata.top_p is not None:
            apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)

        probs = logits.softmax(dim=-1)  # [num_reqs, vocab]
        random = self._exponential_race(probs, metadata.generators)  # [num_reqs]
        if greedy is None:
            return random
        return torch.where(metadata.temperature < GREEDY_EPS, greedy, random)

    def _exponential_race(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """argmax(p / q) with q ~ Exp(1) picks token i with probability p_i, one row at a time.

        A seeded row fills its whole q row from its own generator, so its draw depends only
        on its seed, its step count and its own probabilities, never on the batch around it.
        """
        q = torch.empty_like(probs)  # [num_reqs, vocab]
        if len(generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        # Exp(1) may return exactly 0; keep the ratio finite (0 / 0 would be NaN).
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Mask stop ids (EOS included) of rows that have not produced min_tokens outputs yet."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_tokens, stop_ids) in metadata.min_tokens.items():
        if len(metadata.output_token_ids[row]) < min_tokens:
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)  # [2, n]
        logits[index[0], index[1]] = float("-inf")


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Repetition (over prompt and output), then frequency and presence (over output only)."""
    num_reqs, vocab = logits.shape
    outputs = metadata.output_token_ids
    # The output lists grow every step, so their counts are rebuilt every step.
    lengths = torch.tensor([len(o) for o in outputs], dtype=torch.int64)  # [num_reqs]
    flat = torch.tensor(list(itertools.chain.from_iterable(outputs)), dtype=torch.int64)
    rows = torch.arange(num_reqs).repeat_interleave(lengths)  # [total_outputs]
    counts = torch.zeros(num_reqs, vocab, dtype=logits.dtype, device=logits.device)
    counts.index_put_(
        (rows.to(logits.device), flat.to(logits.device)),
        torch.ones((), dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )  # [num_reqs, vocab]
    in_output = counts > 0  # [num_reqs, vocab]

    seen = in_output
    if metadata.prompt_token_ids is not None:
        # One extra column catches the padding id (= vocab) and is then dropped.
        prompt_mask = torch.zeros(num_reqs, vocab + 1, dtype=torch.bool, device=logits.device)
        prompt_mask.scatter_(1, metadata.prompt_token_ids.to(logits.device), True)
        seen = in_output | prompt_mask[:, :vocab]

    rep = metadata.repetition_penalties.unsqueeze(1)  # [num_reqs, 1]
    # Dividing a positive logit and multiplying a negative one both push it toward unlikely.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [num_reqs, vocab]
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(metadata.frequency_penalties.unsqueeze(1) * counts)
    logits.sub_(metadata.presence_penalties.unsqueeze(1) * in_output)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    """Mask to -inf what top-k (ties with the k-th logit stay) and then top-p rule out.

    top-p keeps the most likely tokens up to and including the first one at which the
    cumulative probability (after top-k) reaches p; the most likely token always stays.
    """
    num_reqs, vocab = logits.shape
    k_off = None
    k_index = None  # [num_reqs, 1]: position of each row's k-th largest logit
    if top_k is not None:
        k_off = (top_k <= 0) | (top_k >= vocab)  # [num_reqs]
        k_index = torch.where(k_off, 1, top_k).clamp(max=vocab).sub(1).unsqueeze(1)

    if top_p is None:
        assert top_k is not None and k_index is not None and k_off is not None
        # Only the largest k are needed: topk is cheaper than sorting the whole vocabulary.
        max_k = int(k_index.max()) + 1
        kth = logits.topk(max_k, dim=-1).values.gather(1, k_index)  # [num_reqs, 1]
        kth.masked_fill_(k_off.unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
        return

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_reqs, vocab] each
    if k_index is not None and k_off is not None:
        kth = sorted_logits.gather(1, k_index)  # [num_reqs, 1]
        kth.masked_fill_(k_off.unsqueeze(1), float("-inf"))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))

    probs = sorted_logits.softmax(dim=-1)  # [num_reqs, vocab]
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # probability of all strictly earlier tokens
    drop = mass_before >= top_p.unsqueeze(1)  # [num_reqs, vocab]
    # Rows with p = 1 keep everything, even where float32 rounding lifts the sum past 1.
    drop &= (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p times the row's top probability.

    Compared in log space, where p_i / p_max = exp(l_i - l_max): no softmax needed, and
    min_p = 0 gives a threshold of -inf, which masks nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [num_reqs, 1]
    logits.masked_fill_(logits < threshold, float("-inf"))


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, n: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the n most likely tokens, most likely first."""
    n = min(n, raw_logprobs.shape[1])
    sampled_col = sampled.unsqueeze(1)  # [num_reqs, 1]
    sampled_lp = raw_logprobs.gather(1, sampled_col)  # [num_reqs, 1]
    top_lp, top_ids = raw_logprobs.topk(n, dim=-1)  # [num_reqs, n] each
    # Rank 1 + the number of strictly more likely tokens, so ties share the better rank.
    rank = (raw_logprobs > sampled_lp).sum(dim=-1).add_(1)  # [num_reqs]
    return LogprobsTensors(
        token_ids=torch.cat([sampled_col, top_ids], dim=1),
        logprobs=torch.cat([sampled_lp, top_lp], dim=1),
        sampled_rank=rank,
    )
