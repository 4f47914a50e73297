"""Stop strings for tests that cross a token boundary, chosen from a run's own output."""

from __future__ import annotations

from typing import Any


def stop_across_tokens(tokenizer: Any, ids: list[int]) -> tuple[str, int, int] | None:
    """A stop string of two characters, the last of one token's text and the first of the
    next's, found nowhere before: (the string, where it starts in the text, the number of tokens
    up to the one that completes it). At least 3 tokens follow it, so that an engine running on
    samples past it. None when the output has no such pair."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids) - 4):
        head = tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
        nxt = tokenizer.decode(ids[:k + 2], skip_special_tokens=True)
        b = len(head)
        if (0 < b < len(nxt) and text.startswith(nxt) and "\ufffd" not in nxt
                and text.find(text[b - 1:b + 1]) == b - 1):
            return text[b - 1:b + 1], b - 1, k + 2
    return None
