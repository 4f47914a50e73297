"""A conversation rendered through the model's chat template into prompt token ids.

The template's own markers (`<|im_start|>`, `<|im_end|>`) are special tokens; the messages' text
never is. Rendering the whole conversation to text and tokenizing it once would turn a user's
literal "<|im_start|>system" into the real turn marker, letting them forge a system turn. So each
message's content enters the template as a placeholder, the rendered text is split at the
placeholders, and the template's pieces are tokenized with special tokens recognised while the
contents are tokenized with special tokens read as plain text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from scheduler_svc.core.errors import InvalidRequestError

# Private-use characters around a message's index: no template changes them, and no content may
# hold them (such a content is refused: it could move the split).
_OPEN, _CLOSE = "\uf8f0", "\uf8f1"


def chat_prompt_ids(tokenizer: Any, conversation: Sequence[dict[str, Any]],
                    field: str = "messages", tools: list[dict[str, Any]] | None = None
                    ) -> list[int]:
    """`conversation`: [{"role", "content", ...}] (extra keys, e.g. tool calls, go to the
    template as they are); `tools`: the template's `tools` variable. Raises
    InvalidRequestError naming `field` when the model has no template or the template refuses
    the conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(field, "the model has no chat template: send text or token_ids")
    _check_no_special_text(tokenizer, conversation, tools, field)
    contents: list[str] = []
    placeheld = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, str):
            if _OPEN in content or _CLOSE in content:
                raise InvalidRequestError(f"{field}[{i}].content", "holds the private-use "
                                          "characters U+F8F0 or U+F8F1, which are reserved")
            message = {**message, "content": f"{_OPEN}{len(contents)}{_CLOSE}"}
            contents.append(content)
        placeheld.append(message)
    try:
        text = tokenizer.apply_chat_template(placeheld, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # the template's own checks (e.g. roles that must alternate)
        raise InvalidRequestError(field, f"the chat template refused them: {e}") from None
    ids: list[int] = []
    for n, piece in enumerate(text.split(_OPEN)):
        if n > 0:
            index, sep, piece = piece.partition(_CLOSE)
            if not sep or not index.isdigit() or int(index) >= len(contents):
                raise InvalidRequestError(field, "the chat template changed a message's content "
                                                 "in a way this server cannot tokenize safely")
            ids += tokenizer(contents[int(index)], add_special_tokens=False,
                             split_special_tokens=True).input_ids
        # The rendered template already holds the special tokens it wants.
        ids += tokenizer(piece, add_special_tokens=False).input_ids if piece else []
    return ids


def _check_no_special_text(tokenizer: Any, conversation: Sequence[dict[str, Any]],
                           tools: list[dict[str, Any]] | None, field: str) -> None:
    """What the template renders itself (tools, earlier calls) is tokenized with the template,
    special tokens recognised: such text must spell none of them."""
    rendered = [("tools", tools)] if tools else []
    rendered += [(f"{field}[{i}].tool_calls", m["tool_calls"])
                 for i, m in enumerate(conversation) if m.get("tool_calls")]
    if not rendered:
        return
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    specials = [t.content for t in added if t.special and t.content]
    for where, value in rendered:
        text = json.dumps(value, ensure_ascii=False)
        for special in specials:
            if special in text:
                raise InvalidRequestError(where, f"holds the model's special token {special!r}")
