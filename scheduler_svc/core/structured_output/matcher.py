"""One request's place in its grammar: which tokens may come next, and whether it is done.

The state moves only when a sampled token is accepted, and sampled tokens are never recomputed:
a preempted request recomputes its KV cache but keeps its matcher as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestGrammar:
    __slots__ = ("matcher", "stop_token_ids", "finished")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        # The engine's EOS ids end the grammar, whatever the tokenizer file calls EOS.
        self.stop_token_ids = sorted(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids
                                          or None)
        self.finished = False  # terminated, or met a token it could not accept

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] ([rows, words] int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if not bitmask[row].any():
            # A dead end the admission check could not foresee: let the request end rather
            # than sample from an all -inf row.
            words = bitmask.view(np.uint32)
            for t in self.stop_token_ids:
                words[row, t // 32] |= np.uint32(1 << (t % 32))

    def accept(self, token: int) -> bool:
        """Advances past the request's sampled token; True when the grammar ends the request."""
        if not self.matcher.accept_token(token) or self.matcher.is_terminated():
            self.finished = True
        return self.finished
