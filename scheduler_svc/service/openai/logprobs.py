"""Logprobs in OpenAI's two shapes: the completions one (parallel lists, top-n as a dict keyed
by token text) and the chat one (one object per token, with its UTF-8 bytes).

A token's text is its own decoding (a byte of a character split across tokens decodes to U+FFFD,
as in vLLM); decodings are cached per token id, since a stream asks for the same ones often.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batchwire.v1 import generate_pb2

_CACHE_LIMIT = 1 << 16


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            if len(self._cache) < _CACHE_LIMIT:
                self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """Accumulates one choice's completions-style logprobs, prompt (echo) first."""

    def __init__(self, text_of: TokenText) -> None:
        self.text_of = text_of
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._offset = 0

    def _add_token(self, token_id: int) -> str:
        text = self.text_of(token_id)
        self.tokens.append(text)
        self.text_offset.append(self._offset)
        self._offset += len(text)
        return text

    def add_unscored(self, token_id: int) -> None:
        """The prompt's first token: nothing before it to be scored against."""
        self._add_token(token_id)
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)

    def add(self, entries: Iterable[generate_pb2.TokenLogprob]) -> None:
        for lp in entries:
            text = self._add_token(lp.token_id)
            self.token_logprobs.append(lp.logprob)
            top = {self.text_of(t.token_id): t.logprob for t in lp.top_logprobs}
            top[text] = lp.logprob  # the token itself is always listed, as vLLM does
            self.top_logprobs.append(top)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        """From entry start on (a streamed chunk sends only what is new)."""
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:],
                "text_offset": self.text_offset[start:]}

    def __len__(self) -> int:
        return len(self.tokens)


def chat_logprobs(entries: Iterable[generate_pb2.TokenLogprob], text_of: TokenText,
                  top: int) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**one(lp.token_id, lp.logprob),
             "top_logprobs": [one(t.token_id, t.logprob) for t in lp.top_logprobs[:top]]}
            for lp in entries]
