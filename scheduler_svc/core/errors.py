"""Errors a request can meet on its way in; a service maps each to one status code, in one place.

InvalidRequestError -> INVALID_ARGUMENT, QueueFullError -> RESOURCE_EXHAUSTED.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request refused on arrival, naming the field that was wrong and its value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFullError(RuntimeError):
    """The waiting queue already holds max_queued_requests requests."""


class RequestIdInUseError(ValueError):
    """An active request already has this id (the client's ids must be unique while active)."""
