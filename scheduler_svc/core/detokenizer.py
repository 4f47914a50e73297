"""Token ids to text, one step at a time, with stop strings.

Decoding each new token alone is wrong twice over: a character whose UTF-8 bytes are split across
tokens decodes to U+FFFD halves, and tokenizers that mark word starts (SentencePiece) drop the
leading space of a token decoded without its left neighbour. So each step decodes a short window
that starts a few tokens back and keeps only what the new tokens added, waiting while the text
ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5  # tokens kept as left context (the prompt's, for the first output token)
_MAX_WINDOW = 16  # the decoded window is cut back to _CONTEXT_TOKENS beyond this
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        # The Rust tokenizer behind a fast Hugging Face tokenizer decodes ~4x faster than the
        # Python wrapper; both take (ids, skip_special_tokens).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = backend.decode if backend is not None else tokenizer.decode
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: context for the tokens not yet turned into text
        self._read_offset = len(self._ids)  # tokens before this are already in self.text
        self._prefix_text: str | None = None  # the text of ids[prefix:read], once decoded
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        # Text that may still turn out to be the start of a stop string is held back.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the output text so far (ends before a stop string once one is found)
        self._emitted = 0  # len(self.text) already handed out by update()

    def update(self, new_token_ids: Sequence[int], finished: bool = False
               ) -> tuple[str, str | None]:
        """Adds tokens; returns (text to stream now, the stop string found or None).

        `finished` flushes everything, including a trailing incomplete character and held-back text.
        """
        self._ids.extend(new_token_ids)
        added = self._decode_new(flush=finished)
        stop_hit = None
        if added:
            start = len(self.text)
            self.text += added
            stop_hit = self._find_stop(start)
        if stop_hit is not None or finished:
            delta, self._emitted = self.text[self._emitted:], len(self.text)
            return delta, stop_hit
        end = max(len(self.text) - self._holdback, self._emitted)
        delta, self._emitted = self.text[self._emitted:end], end
        return delta, None

    def _decode_new(self, flush: bool) -> str:
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(
                ids[prefix:read], skip_special_tokens=self._skip_special)
        full_text = self._decode(ids[prefix:], skip_special_tokens=self._skip_special)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_INCOMPLETE) and not flush):
            return ""  # a character still waits for its remaining bytes (or nothing visible)
        # The whole window is text now and becomes the next step's left context, whose text is
        # full_text: one decode per step, not two. Past _MAX_WINDOW tokens it is cut back to the
        # last _CONTEXT_TOKENS, and that shorter context is decoded once, next step.
        if len(ids) > _MAX_WINDOW:
            del ids[: len(ids) - _CONTEXT_TOKENS]
            self._prefix_offset, self._read_offset, self._prefix_text = 0, len(ids), None
        else:
            self._read_offset, self._prefix_text = len(ids), full_text
        return full_text[len(prefix_text):]

    def _find_stop(self, start: int) -> str | None:
        """The earliest stop string ending in the text added at `start`; cuts self.text there."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(start - len(s) + 1, 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s) if self.include_stop else i]
        return s
