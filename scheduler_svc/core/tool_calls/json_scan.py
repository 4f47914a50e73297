"""Reading tool calls out of JSON that may still be arriving: a call's name as soon as its
string has closed, its arguments' text as far as it has been written.

A call is an object `{"name": ..., "arguments": {...}}` (Llama 3 writes `"parameters"`). A
payload holds one call, a list of calls, or calls separated by `,` or `;`. Scanning stops at
the first thing that cannot be (the start of) such a payload and says so: that text was not a
call after all, unless calls were read before it.
"""

from __future__ import annotations

import dataclasses
import json

ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR_END = frozenset(",}]; \t\r\n")


@dataclasses.dataclass(slots=True)
class PartialCall:
    name: str | None = None  # set once the name's string has closed
    arguments: str = ""  # the arguments' JSON text as far as written ("" before it starts)
    arguments_done: bool = False  # their value has ended
    done: bool = False  # the call's object has closed


@dataclasses.dataclass(slots=True)
class Scan:
    calls: list[PartialCall]
    broken: bool = False  # text that cannot be part of a call payload was met


def scan_calls(payload: str) -> Scan:
    scan = Scan([])
    i = _skip_space(payload, 0)
    if payload.startswith("[", i):
        i += 1
    while True:
        i = _skip_space(payload, i, separators=",;]")
        if i >= len(payload):
            return scan
        if payload[i] != "{":
            scan.broken = True
            return scan
        call = PartialCall()
        scan.calls.append(call)
        i = _read_call(payload, i + 1, call, scan)
        if i < 0:
            return scan


def _read_call(s: str, i: int, call: PartialCall, scan: Scan) -> int:
    """Fills `call` from the object's members starting at s[i]; the index after its closing
    brace, or -1 when the payload ends (or breaks) inside it."""
    while True:
        i = _skip_space(s, i, separators=",")
        if i >= len(s):
            return -1
        if s[i] == "}":
            call.done = True
            return i + 1
        key_end = _value_end(s, i) if s[i] == '"' else None
        if s[i] != '"' or key_end is None:
            scan.broken = s[i] != '"'
            return -1
        key = _string(s, i, key_end)
        i = _skip_space(s, key_end)
        if i >= len(s):
            return -1
        if s[i] != ":" or key is None:
            scan.broken = True
            return -1
        i = _skip_space(s, i + 1)
        end = _value_end(s, i) if i < len(s) else None
        if key in ARGUMENT_KEYS:
            call.arguments = s[i:end]
            call.arguments_done = end is not None
        elif key == "name" and end is not None:
            name = _string(s, i, end)
            if name is None:
                scan.broken = True
                return -1
            call.name = name
        if end is None:
            return -1
        i = end


def _string(s: str, start: int, end: int) -> str | None:
    """The JSON string s[start:end], or None when it is not one."""
    try:
        value = json.loads(s[start:end])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _skip_space(s: str, i: int, separators: str = "") -> int:
    while i < len(s) and (s[i].isspace() or s[i] in separators):
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """The index just after the JSON value that starts at s[i], or None when s ends first (a
    scalar is ended only by what follows it: `12` may go on as `123`)."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] not in "{[":
        j = i
        while j < len(s) and s[j] not in _SCALAR_END:
            j += 1
        return j if j < len(s) else None
    depth = 0
    j = i
    while j < len(s):
        c = s[j]
        if c == '"':
            end = _string_end(s, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None
