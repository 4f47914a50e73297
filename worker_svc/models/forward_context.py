"""The step's attention metadata, reached by the attention layers rather than passed as arguments.

The runner installs it around the forward pass; the model's signature stays (input_ids, positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from batchwire.kernels import AttentionMetadata

_current: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers ran outside set_forward_context()")
    return _current
