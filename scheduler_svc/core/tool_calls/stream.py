"""A reply's text split, as it streams, into plain text and tool calls.

Text that may be the start of a call's tag is held back until it is known to be one or not; a
call is announced (its index, a fresh id, its name) as soon as its name has been written, and
its arguments follow in fragments as the model writes them. Fed a whole reply at once it gives
the same calls and text as fed any split of it; `parse` is that.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from scheduler_svc.core.tool_calls.formats import ToolCallFormat
from scheduler_svc.core.tool_calls.json_scan import PartialCall, scan_calls


@dataclasses.dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # the call's place among the reply's calls
    arguments: str  # the next fragment of the arguments' JSON text
    id: str | None = None  # on a call's first delta only, with its name
    name: str | None = None


@dataclasses.dataclass(slots=True)
class Deltas:
    text: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclasses.dataclass(slots=True)
class ParsedReply:
    content: str | None  # None when the reply is only calls
    calls: list[ToolCall]


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buffer = ""  # text received, not yet sent nor read as a call
        self.in_call = False
        self.opener = ""  # the text that opened the current call region
        self.at_start = True  # nothing but whitespace sent yet (bare JSON may still come)
        self.first = 0  # the index of the current region's first call
        self.sent: list[int] = []  # per call of the region: argument characters sent (-1: none)
        self.calls = 0  # calls announced in earlier regions

    def feed(self, text: str) -> Deltas:
        self.buffer += text
        out = Deltas()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Deltas:
        out = Deltas()
        while self._step(out, final=True):
            pass
        if self.in_call:
            self._advance(self.buffer, out, closed=True)
            self._close_region(self.buffer, "", out)
        else:
            self._text(self.buffer, out)
        self.buffer = ""
        return out

    def _step(self, out: Deltas, final: bool) -> bool:
        """One move through the buffer; False when it needs more text."""
        fmt = self.fmt
        if not self.in_call:
            if self.at_start and fmt.bare_json_at_start:
                stripped = self.buffer.lstrip()
                if stripped.startswith("{"):
                    self._open(len(self.buffer) - len(stripped), 0)
                    return True
                if not final and fmt.open_tag.startswith(stripped) and stripped != fmt.open_tag:
                    return False  # empty so far, or maybe the tag
            k = self.buffer.find(fmt.open_tag)
            if k >= 0 and (fmt.close_tag is not None or self.at_start
                           and not self.buffer[:k].strip()):
                self._text(self.buffer[:k], out)
                self._open(k, len(fmt.open_tag))
                return True
            keep = 0 if final else _partial_suffix(self.buffer, fmt.open_tag)
            self._text(self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        close = fmt.close_tag
        k = self.buffer.find(close) if close is not None else -1
        if k < 0:
            keep = 0 if final or close is None else _partial_suffix(self.buffer, close)
            payload = self.buffer[:len(self.buffer) - keep]
            if not self._advance(payload, out, closed=False):
                self._close_region(self.buffer, "", out)  # not a call: its text goes out
                self.buffer = ""
            return False
        assert close is not None
        payload = self.buffer[:k]
        self._advance(payload, out, closed=True)
        self.buffer = self.buffer[k + len(close):]
        self._close_region(payload, close, out)
        return True

    def _open(self, start: int, tag_length: int) -> None:
        self.opener = self.buffer[start:start + tag_length]
        self.buffer = self.buffer[start + tag_length:]
        self.in_call, self.first, self.sent = True, self.calls, []
        self.at_start = False

    def _close_region(self, payload: str, closer: str, out: Deltas) -> None:
        """The region has ended: with no call in it, its text was not a call after all."""
        if not self.sent:
            self._text(self.opener + payload + closer, out)
        self.calls = self.first + len(self.sent)
        self.in_call = False

    def _advance(self, payload: str, out: Deltas, closed: bool) -> bool:
        """Sends what the region's payload says now; False when it turned out not to be
        calls (broken before any was announced)."""
        scan = scan_calls(payload)
        for j, call in enumerate(scan.calls):
            if j == len(self.sent):
                if call.name is None:
                    break
                self.sent.append(-1)
                out.calls.append(CallDelta(self.first + j, "", new_call_id(),
                                           call.name))
            fragment = self._fragment(call, self.sent[j], closed)
            if fragment:
                self.sent[j] = max(self.sent[j], 0) + len(fragment)
                out.calls.append(CallDelta(self.first + j, fragment))
        return bool(self.sent) or not scan.broken

    @staticmethod
    def _fragment(call: PartialCall, sent: int, closed: bool) -> str:
        """The arguments' text not sent yet. An object streams as written; anything else (a
        JSON string holding the object, a missing value) goes once, whole, at the end."""
        if call.arguments.startswith("{"):
            return call.arguments[max(sent, 0):]
        if sent >= 0 or not (call.done or call.arguments_done or closed):
            return ""
        if call.arguments.startswith('"') and call.arguments_done:
            try:
                decoded = json.loads(call.arguments)
            except ValueError:  # a bad escape: as written
                return call.arguments
            return decoded if decoded.strip() else "{}"
        return call.arguments or "{}"

    def _text(self, text: str, out: Deltas) -> None:
        if text:
            out.text += text
            if text.strip():
                self.at_start = False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse(fmt: ToolCallFormat, text: str) -> ParsedReply:
    """A whole reply's text and calls. Arguments that are JSON come back re-serialised."""
    stream = ToolCallStream(fmt)
    first, last = stream.feed(text), stream.finish()
    content = first.text + last.text
    calls: list[ToolCall] = []
    for delta in first.calls + last.calls:
        if delta.name is not None:
            calls.append(ToolCall(delta.id or "", delta.name, ""))
        calls[delta.index].arguments += delta.arguments
    for call in calls:
        try:
            call.arguments = json.dumps(json.loads(call.arguments), ensure_ascii=False)
        except ValueError:
            pass  # cut short (max_tokens): as written
    return ParsedReply(content if not calls or content.strip() else None, calls)
