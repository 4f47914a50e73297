"""What a request's output must follow: one constraint, checked for shape on arrival.

The text of a constraint is also its cache key: two requests with the same kind and text share one
compiled grammar.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from scheduler_svc.core.errors import InvalidRequestError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

# Checked before any parser sees the text. Deep nesting overflows Python's JSON parser (a
# RecursionError) and xgrammar's compile time grows with about the cube of it (a schema nested
# 200 levels deep takes seconds, 500 levels tens of seconds); real schemas nest a few levels.
MAX_CONSTRAINT_CHARS = 128 * 1024
MAX_CONSTRAINT_DEPTH = 64
# What does not count towards nesting: escaped characters, quoted strings (JSON, EBNF) and
# character classes (regex, EBNF), whose brackets are literal.
_NOT_NESTING = {
    "json_schema": re.compile(r'\\.|"(?:[^"\\]|\\.)*"', re.S),
    "regex": re.compile(r"\\.|\[(?:[^\]\\]|\\.)*\]", re.S),
    "grammar": re.compile(r'\\.|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', re.S),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    kind: Kind
    # json_schema: the schema as JSON text; regex, grammar: as given; choice: the JSON list of the
    # strings; json_object: "".
    text: str

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []


def constraint_from_fields(json_schema: str | dict | None = None, json_object: bool = False,
                           regex: str | None = None, choice: Any = None,
                           grammar: str | None = None) -> Constraint | None:
    """The one constraint among the fields set (None for none); refuses several, or a bad shape.
    An error names the field as SamplingParams spells it."""
    given = {"json_schema": json_schema, "json_object": json_object or None, "regex": regex,
             "choice": choice, "grammar": grammar}
    present = [k for k in KINDS if given[k] is not None]
    if not present:
        return None
    if len(present) > 1:
        raise InvalidRequestError("constraint", f"set at most one of {', '.join(KINDS)} "
                                                f"(got {', '.join(present)})")
    kind = present[0]
    value = given[kind]
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(kind, f"{value!r} must be a bool")
        return Constraint(kind, "")
    if kind == "choice":
        return Constraint(kind, _within_bounds(kind, _choices_text(value)))
    if kind == "json_schema":
        return Constraint(kind, _schema_text(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(kind, f"{value!r} must be a non-empty string")
    return Constraint(kind, _within_bounds(kind, value))


def _within_bounds(kind: Kind, text: str) -> str:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(kind, f"is {len(text)} characters long; the limit is "
                                        f"{MAX_CONSTRAINT_CHARS}")
    pattern = _NOT_NESTING.get(kind)
    if pattern is not None:
        depth = nesting_depth(pattern.sub("", text))
        if depth > MAX_CONSTRAINT_DEPTH:
            raise InvalidRequestError(kind, f"nests {depth} levels deep; the limit is "
                                            f"{MAX_CONSTRAINT_DEPTH}")
    return text


def nesting_depth(text: str) -> int:
    """The deepest nesting of brackets of any kind; unbalanced ones are left to the parser."""
    depth = deepest = 0
    for c in re.findall(r"[()\[\]{}]", text):
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def _choices_text(value: Any) -> str:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidRequestError("choice", f"{value!r} must be a list of strings")
    if not value:
        raise InvalidRequestError("choice", "[] must hold at least one string")
    for s in value:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError("choice", f"{s!r}: every choice must be a non-empty string")
    return json.dumps(list(value), ensure_ascii=False)


def _schema_text(value: Any) -> str:
    if isinstance(value, dict):
        try:  # key order kept: it is the output's order
            return _within_bounds("json_schema", json.dumps(value, ensure_ascii=False))
        except RecursionError:
            raise InvalidRequestError("json_schema", "nests too deep to encode; the limit is "
                                                     f"{MAX_CONSTRAINT_DEPTH}") from None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("json_schema", f"{value!r} must be a JSON object or its text")
    _within_bounds("json_schema", value)  # before the parser, which recursion would overflow
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidRequestError("json_schema", f"is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("json_schema", f"{value[:80]!r} must be a JSON object")
    return value
