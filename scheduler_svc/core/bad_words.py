"""Bad words as the token sequences the worker bans.

A word's tokens depend on what precedes it: byte-level BPE spells "Paris" after a space with
another token than at the start of a text. Both spellings are banned, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduler_svc.core.errors import InvalidRequestError


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The distinct token sequences of each word, bare and after a space; refuses a word with
    none, or any word when there is no tokenizer."""
    if words and tokenizer is None:
        raise InvalidRequestError("bad_words", "bad words need a tokenizer, this engine has none")
    sequences: list[list[int]] = []
    for word in words:
        spellings = [word] if word.startswith(" ") else [word, " " + word]
        found = [list(tokenizer(s, add_special_tokens=False).input_ids) for s in spellings]
        if not found[0]:
            raise InvalidRequestError("bad_words", f"{word!r} tokenizes to nothing")
        for ids in found:
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
