"""Logit shaping a request asks for: a bias per token, an allowed set, banned token sequences.

Applied by the sampler to the logits as SampleTokens received them (the grammar mask already
applied), before min_tokens, penalties and sampling. The static parts (bias, allowed set) are
tensors built once per batch membership; banned sequences depend on the output so far and are
matched each step, on the few rows that have any.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch


class ShapingParamsLike(Protocol):
    """The shaping fields of batchwire.v1.RequestSamplingParams."""

    logit_bias: Mapping[int, float]
    allowed_token_ids: Sequence[int]
    bad_words: Sequence  # of messages with `ids`, the banned token sequences


@dataclasses.dataclass(slots=True)
class LogitShaping:
    """One batch's shaping; None in SamplingMetadata when no row asks for any."""

    bias_rows: torch.Tensor  # [num_biases] int64
    bias_tokens: torch.Tensor  # [num_biases] int64
    bias_values: torch.Tensor  # [num_biases] float32
    allowed_rows: torch.Tensor  # [num_allowed_rows] int64
    allowed: torch.Tensor  # [num_allowed_rows, vocab] bool, True = may be sampled
    bad_words: dict[int, list[list[int]]]  # row -> banned token sequences, each non-empty


def build_logit_shaping(
    params: Sequence[ShapingParamsLike], vocab_size: int, device: torch.device | str = "cpu"
) -> LogitShaping | None:
    """Stacks the rows' shaping into tensors. Ids outside the vocabulary were refused by the
    worker's validation; they are skipped here too, so no index can run off the logits."""
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    allowed_rows: list[int] = []
    allowed_ids: list[list[int]] = []
    bad_words: dict[int, list[list[int]]] = {}
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            if 0 <= token < vocab_size and bias != 0.0:
                bias_rows.append(row)
                bias_tokens.append(token)
                bias_values.append(max(-100.0, min(100.0, float(bias))))
        ids = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
        if ids:
            allowed_rows.append(row)
            allowed_ids.append(ids)
        banned = [list(w.ids) for w in p.bad_words
                  if w.ids and all(0 <= t < vocab_size for t in w.ids)]
        if banned:
            bad_words[row] = banned
    if not (bias_rows or allowed_rows or bad_words):
        return None

    allowed = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool, device=device)
    for i, ids in enumerate(allowed_ids):
        allowed[i, torch.tensor(ids, dtype=torch.int64, device=device)] = True

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return LogitShaping(
        bias_rows=i64(bias_rows),
        bias_tokens=i64(bias_tokens),
        bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device),
        allowed_rows=i64(allowed_rows),
        allowed=allowed,
        bad_words=bad_words,
    )


def shaping_for_rows(shaping: LogitShaping, rows: np.ndarray) -> LogitShaping:
    """The shaping of a step whose logits row i belongs to batch row rows[i] (a step with drafts
    has 1 + d logits rows per request): each batch row's shaping on each of its logits rows."""
    by_row: dict[int, list[int]] = {}
    for i, row in enumerate(rows.tolist()):
        by_row.setdefault(row, []).append(i)

    def spread(batch_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into the entries, logits row) for every copy of every entry."""
        pairs = [(k, i) for k, row in enumerate(batch_rows.tolist()) for i in by_row.get(row, ())]
        index = torch.tensor([k for k, _ in pairs], dtype=torch.int64, device=batch_rows.device)
        spread_rows = torch.tensor([i for _, i in pairs], dtype=torch.int64,
                                   device=batch_rows.device)
        return index, spread_rows

    bias_index, bias_rows = spread(shaping.bias_rows)
    allowed_index, allowed_rows = spread(shaping.allowed_rows)
    return LogitShaping(
        bias_rows=bias_rows,
        bias_tokens=shaping.bias_tokens[bias_index],
        bias_values=shaping.bias_values[bias_index],
        allowed_rows=allowed_rows,
        allowed=shaping.allowed[allowed_index],
        bad_words={i: words for row, words in shaping.bad_words.items()
                   for i in by_row.get(row, ())},
    )


def apply_logit_shaping(
    logits: torch.Tensor, shaping: LogitShaping, output_token_ids: Sequence[Sequence[int]]
) -> None:
    """logits: [num_reqs, vocab], modified in place; output_token_ids: per row, the output so far.

    The allowed set first, so that a bias cannot lift a masked token back (-inf + b = -inf).
    """
    if shaping.allowed_rows.numel():
        rows = logits[shaping.allowed_rows]  # [num_allowed_rows, vocab], a copy
        logits[shaping.allowed_rows] = rows.masked_fill_(~shaping.allowed, float("-inf"))
    if shaping.bias_rows.numel():
        biases = shaping.bias_values.to(logits.dtype)
        logits.index_put_((shaping.bias_rows, shaping.bias_tokens), biases, accumulate=True)
    for row, sequences in shaping.bad_words.items():
        output = output_token_ids[row]
        for seq in sequences:
            prefix = len(seq) - 1
            # A one-token word is always banned; a longer one once its prefix ends the output.
            if prefix == 0 or (len(output) >= prefix and list(output[-prefix:]) == seq[:-1]):
                logits[row, seq[-1]] = float("-inf")
