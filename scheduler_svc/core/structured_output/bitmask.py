"""The step's grammar bitmask: one packed int32 row per constrained request that samples."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from batchwire.v1 import worker_pb2

from scheduler_svc.core.structured_output.matcher import RequestGrammar


def build_grammar_output(req_ids: Sequence[str], grammars: Sequence[RequestGrammar],
                         vocab_size: int) -> worker_pb2.GrammarOutput:
    """Rows in the order of req_ids; bit j of word i set = token 32 * i + j allowed."""
    bitmask = np.empty((len(req_ids), (vocab_size + 31) // 32), dtype=np.int32)  # [rows, words]
    for row, grammar in enumerate(grammars):
        grammar.fill(bitmask, row)  # writes every word of its row
    return worker_pb2.GrammarOutput(req_ids=req_ids,
                                    bitmask=bitmask.astype("<i4", copy=False).tobytes())
