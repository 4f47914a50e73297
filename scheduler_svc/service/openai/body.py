"""A request body as the routes read it: bounded while it arrives, parsed off the event loop
when large, and refused with a 4xx naming what was wrong before any handler sees it.

- More than the limit (--max-request-bytes; by default sized from the model, see
  `default_max_request_bytes`) is a 413: the bytes past the limit are dropped as they arrive
  (DISCARD_BYTES), so a 50 MB body is never held whole, and never parsed.
- Bytes that are not UTF-8, JSON that is not JSON (NaN and Infinity included: they are not in
  the standard and no OpenAI field takes them), nesting deeper than MAX_DEPTH, numbers that
  overflow a float (1e400) and text holding a lone UTF-16 surrogate (which no tokenizer or
  protobuf string can encode) are a 400, the last two naming the field.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

OFF_LOOP_BYTES = 64 << 10  # larger bodies are parsed in a thread (a few ms of parsing at most here)
MAX_DEPTH = 64  # JSON nesting: a JSON schema or tool parameters need a dozen levels
# A body over the limit is still read, and dropped, up to this size, so that a client that
# sends it whole before reading the answer (most do) gets the 413 rather than a connection
# reset; it costs loopback time, not memory. Beyond it the connection closes unread.
DISCARD_BYTES = 64 << 20
MIN_MAX_REQUEST_BYTES = 1 << 20  # the floor of the default, and the limit while loading
_SURROGATE = re.compile("[\ud800-\udfff]")


def default_max_request_bytes(max_prompt_chars: int) -> int:
    """The largest body worth reading: the longest text prompt the server accepts at all
    (max_model_len times the longest token, in characters) at 4 bytes per character (UTF-8's
    most), with room for the rest of the request; never under 1 MiB. Anything larger cannot
    fit max_model_len, so reading it only costs memory (a 50 MB JSON list of ids is ~6 GB of
    Python ints) and event-loop time."""
    return max(MIN_MAX_REQUEST_BYTES, 4 * max_prompt_chars + (64 << 10))


class BodyError(HTTPException):
    """A refused body. An HTTPException, so that FastAPI's own body parsing lets it through
    unchanged; errors.install turns it into an OpenAI error object with its param."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


class BoundedRequest(Request):
    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.front.max_request_bytes()
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max(limit, DISCARD_BYTES):
                raise _too_large(int(declared), limit)  # the connection closes unread
            chunks: list[bytes] = []
            size = 0
            async for chunk in self.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > DISCARD_BYTES:
                    raise _too_large(size, limit, "at least ")
            if size > limit:
                raise _too_large(size, limit)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse, body)
            else:
                self._json = parse(body)
        return self._json


class BoundedRoute(APIRoute):
    """Routes whose handlers read the body through BoundedRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(BoundedRequest(request.scope, request.receive))

        return bounded


def _too_large(size: int, limit: int, qualifier: str = "") -> BodyError:
    return BodyError(413, f"request body of {qualifier}{size} bytes is larger than the "
                     f"server's limit of {limit} bytes (--max-request-bytes)")


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"body: {name} is not JSON (numbers must be finite)")


def parse(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"body: not UTF-8: bytes {body[e.start:e.end + 2]!r} at offset "
                        f"{e.start}") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(400, f"body: nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno}, column "
                        f"{e.colno} (character {e.pos})") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise BodyError(400, f"the body is not valid JSON: {e}") from None
    check_text(value)
    return value


def check_text(value: Any) -> None:
    """Refuses nesting deeper than MAX_DEPTH, any string (or key) holding a lone surrogate, and
    a number too large for a float (`1e400` parses as infinity), naming where:
    `messages[0].content`. Iterative, so that depth cannot overflow the stack."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BodyError(400, f"body: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, float):
            _check_float(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_string(key, path or "body", "a key of ")
                if isinstance(child, dict | list | str | float):
                    stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                if isinstance(child, dict | list | str | float):
                    stack.append((child, f"{path}[{i}]", depth + 1))


def _check_float(number: float, path: str) -> None:
    if not math.isfinite(number):
        raise BodyError(400, f"{path or 'body'}: a number too large for a float (read as "
                        f"{number}); numbers must be finite", path or None)


def _check_string(text: str, path: str, what: str = "") -> None:
    match = _SURROGATE.search(text)
    if match:
        param = path or "body"
        raise BodyError(400, f"{param}: {what}a lone UTF-16 surrogate (U+{ord(match.group()):04X}) "
                        f"at character {match.start()} is not text; send valid UTF-8", param)
