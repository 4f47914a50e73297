"""What other threads ask of the engine thread, as typed messages on one queue.

The engine is not thread-safe: a gRPC handler, a registration or a pod watch never touches it
directly. They put a command on the engine's inbox, and the engine thread applies every queued
command between two steps, in order. Each command that has an answer carries a Future for it.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class AddRequest:
    request_id: str  # the client's id
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    pooling: PoolingParams | None = None  # an embedding request's
    lora: LoRARequest | None = None  # the adapter it runs with; None = the base model
    admitted: Future = dataclasses.field(default_factory=Future)  # None, or the refusal


@dataclasses.dataclass(slots=True)
class AbortRequests:
    request_ids: Sequence[str]  # the clients' ids; unknown or finished ones are skipped


@dataclasses.dataclass(slots=True)
class StopRequests:
    """Requests that a stop string ended in the output processor (the clients' ids -> (output
    tokens the client got, the stop string)); already finished ones are skipped."""

    stops: dict[str, tuple[int, str]]


@dataclasses.dataclass(slots=True)
class AttachReplica:
    executor: Any  # a connected Executor of a worker group
    replica_id: str | None = None  # None: the engine names it
    done: Future = dataclasses.field(default_factory=Future)  # the replica id, once it serves


@dataclasses.dataclass(slots=True)
class DetachReplica:
    replica_id: str
    timeout_s: float | None = None  # how long running requests may finish there; None: default
    done: Future = dataclasses.field(default_factory=Future)  # (moved, lost), once it left


Command = AddRequest | AbortRequests | StopRequests | AttachReplica | DetachReplica


def take_on(command: AddRequest) -> bool:
    """Marks an admission as under way; False when its caller already went away (cancelled,
    past its deadline), and the engine must then not admit it. After True the caller can no
    longer cancel the future (it reads the answer, or aborts what was admitted)."""
    if command.admitted.done():
        return False
    return command.admitted.set_running_or_notify_cancel()


def answer(future: Future, result: object = None) -> None:
    """Sets a command's answer; a caller that went away (the future cancelled) is no error of
    the engine's, which must go on for everyone else."""
    try:
        future.set_result(result)
    except InvalidStateError:
        pass


def refuse(future: Future, error: BaseException) -> None:
    """Sets a command's refusal, as answer() does."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass


class Inbox:
    """The engine thread's one queue. `wake` (set by whoever runs the loop) is called after each
    put, so that a loop idling for want of requests wakes up to apply the command."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake: Callable[[], None] | None = None

    def put(self, command: Command) -> None:
        self._queue.put(command)
        if self.wake is not None:
            self.wake()

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self) -> list[Command]:
        """Every command queued so far, oldest first."""
        commands = []
        while True:
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                return commands
