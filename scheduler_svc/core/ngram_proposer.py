"""N-gram prompt lookup: draft tokens for speculative decoding without a draft model.

A request that repeats itself (code, lists, quoted text) often continues an n-gram the way it
continued the last time it appeared. The proposer finds the most recent earlier occurrence of
the request's last n tokens, trying n from max_n down to min_n, and proposes up to k of the
tokens that followed it. Only numpy: the scheduler calls it for every decoding request each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclasses.dataclass(frozen=True, slots=True)
class NgramProposer:
    num_speculative_tokens: int  # k: the most drafts proposed per request and step
    min_n: int = 1  # shortest suffix worth matching (prompt-lookup-min)
    max_n: int = 4  # longest suffix tried first (prompt-lookup-max)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")

    def propose(self, token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """[num_drafts] int32, 0 to k tokens; token_ids is the request's prompt + output."""
        return propose_ngram_drafts(token_ids, self.num_speculative_tokens, self.min_n, self.max_n)


def propose_ngram_drafts(
    token_ids: np.ndarray | Sequence[int], k: int, min_n: int, max_n: int
) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    of token_ids (length max_n down to min_n) that occurred before; empty when none did.

    One vectorised comparison of the whole sequence finds the candidate ends, the positions
    holding the last token; each longer suffix then only re-checks the candidates still
    matching (a handful in most text), never every position.
    """
    tokens = np.asarray(token_ids)  # [L]
    length = tokens.shape[0]
    if k < 1 or length < 2 or min_n > length - 1:
        return _EMPTY
    # Ends e in [0, L - 2] of an occurrence: it must end before the last token, so at least one
    # token follows it; it may overlap the suffix itself.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [num_candidates]
    n = 1  # the suffix length every remaining end matches
    while n < min(max_n, length - 1) and ends.size:
        # Ends that also match one token further back, t[e - n] == t[L - 1 - n].
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return _EMPTY
    start = int(ends[-1]) + 1  # the latest end: ends are ascending
    return tokens[start : start + k].astype(np.int32, copy=False)
