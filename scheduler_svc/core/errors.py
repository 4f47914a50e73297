"""Errors a request can meet on its way in; a service maps each to one status code, in one place.

InvalidRequestError -> INVALID_ARGUMENT, QueueFullError -> RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import re


class InvalidRequestError(ValueError):
    """A request refused on arrival, naming the field that was wrong and its value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RequestRefusedError(InvalidRequestError):
    """A request past admission that the worker refused (its value broke a rule of the worker's
    that admission does not know): only this request fails. Names the sampling field when the
    worker's reason does."""

    def __init__(self, reason: str) -> None:
        match = re.search(r"sampling\.(\w+)=", reason)
        super().__init__(match.group(1) if match else "request",
                         f"the worker refused this request: {reason}")


class QueueFullError(RuntimeError):
    """The waiting queue already holds max_queued_requests requests."""


class RequestIdInUseError(ValueError):
    """An active request already has this id (the client's ids must be unique while active)."""


class WrongTaskError(RuntimeError):
    """A call this server's task does not answer: Generate on an embedding server, or Embed on a
    generation one (FAILED_PRECONDITION: the same call elsewhere may succeed)."""
