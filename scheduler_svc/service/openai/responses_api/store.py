"""Finished responses' conversations, for previous_response_id: in memory, bounded in count and
in characters, the least recently used dropped first. A server restart forgets them."""

from __future__ import annotations

import collections

from scheduler_svc.service.openai.responses_api.items import Turn

MAX_RESPONSES = 1024
MAX_CHARS = 32 << 20  # of contents and arguments, over all stored conversations


def _chars(turns: list[Turn]) -> int:
    return sum(len(t["content"]) + sum(len(c["arguments"]) for c in t.get("tool_calls", ()))
               for t in turns)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._turns: collections.OrderedDict[str, list[Turn]] = collections.OrderedDict()
        self._size: dict[str, int] = {}
        self.chars = 0

    def put(self, response_id: str, turns: list[Turn]) -> None:
        size = _chars(turns)
        if size > self.max_chars:
            return  # larger than the whole store: never kept
        self._turns[response_id], self._size[response_id] = turns, size
        self.chars += size
        while len(self._turns) > self.max_responses or self.chars > self.max_chars:
            oldest, _ = self._turns.popitem(last=False)
            self.chars -= self._size.pop(oldest)

    def get(self, response_id: str) -> list[Turn] | None:
        turns = self._turns.get(response_id)
        if turns is not None:
            self._turns.move_to_end(response_id)
        return turns
