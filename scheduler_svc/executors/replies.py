"""Whether a worker's reply is in, without waiting longer than asked: what lets the replicated
engine step one replica while another's worker is slow or unreachable."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from scheduler_svc.executors.remote import ReplyFuture


def reply_ready(reply: Any, timeout_s: float = 0.0) -> bool:
    """True once reading `reply` (an executor's non-blocking result) would not block: its value
    or its error is in. Waits up to timeout_s for it. A value that is not a future is in."""
    if isinstance(reply, ReplyFuture):
        return reply.wait_ready(timeout_s)
    if isinstance(reply, Future):
        return reply.done() or bool(wait_futures([reply], timeout_s).done)
    return True
