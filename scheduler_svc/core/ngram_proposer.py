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

    One pass per suffix length j, not per position: run[e] stays true while the j tokens ending
    at position e equal the last j tokens. Each pass narrows the candidates, so random text,
    where almost nothing matches, stops after one or two comparisons of the whole sequence.
    """
    tokens = np.asarray(token_ids)  # [L]
    length = tokens.shape[0]
    if k < 1 or length < 2 or min_n > length - 1:
        return _EMPTY
    # Candidate ends e in [0, L - 2]: the occurrence must end before the last token, so at least
    # one token follows it; it may overlap the suffix itself.
    run = np.ones(length - 1, dtype=bool)  # [L - 1]
    best_end = -1
    for j in range(min(max_n, length - 1)):
        # The (j + 1)-th token back from each end e, t[e - j], against the suffix's, t[L-1-j].
        run[j:] &= tokens[: length - 1 - j] == tokens[length - 1 - j]
        run[:j] = False  # ends before j have no token j back
        if not run.any():
            break
        if j + 1 >= min_n:
            # The latest end that still matches j + 1 tokens; longer matches overwrite it.
            best_end = length - 2 - int(np.argmax(run[::-1]))
    if best_end < 0:
        return _EMPTY
    start = best_end + 1
    return tokens[start : start + k].astype(np.int32, copy=False)
