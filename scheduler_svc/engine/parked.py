"""Requests waiting for a replica (worker_grace_s, `--worker-grace-s`): those whose replica died
or left with no other to take them, and new ones that arrive while no replica is live.

A moved request is its Request, which keeps everything its client has seen (output tokens,
grammar matcher; its text lives in the caller's output processor), so placing it later is the
same move as placing it on a survivor at once: the stream goes on with no gap and no
duplicate. A new one is its AddRequest command, whose `admitted` future stays pending until a
replica takes it or the wait ends: to its client the wait is an admission that takes longer.
Each waits until its deadline, then fails with NoReplicaError (UNAVAILABLE), as it would have
at once without a grace period.
"""

from __future__ import annotations

import dataclasses
import time

from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.request import Request
from scheduler_svc.engine.commands import AddRequest


@dataclasses.dataclass(slots=True)
class Parked:
    request_id: str  # the client's id
    deadline: float  # time.monotonic() after which it fails
    arrival: float  # placement order: the oldest first
    request: Request | None = None  # moved: everything it has done on its replica
    command: AddRequest | None = None  # new: not admitted yet

    def stop_output(self, num_output_tokens: int, stop: str) -> EngineCoreOutput:
        """The last output of a moved request a stop string ended while it waits: only moved
        requests have output, so only they can meet a stop string."""
        assert self.request is not None
        return EngineCoreOutput(self.request_id, [], finished=True, finish_reason="stop",
                                stop_reason=stop, num_prompt_tokens=self.request.num_prompt_tokens,
                                num_output_tokens=num_output_tokens)

    def abort_output(self) -> EngineCoreOutput:
        """The last output of a request aborted while it waits (finish_reason "abort")."""
        if self.request is not None:
            return EngineCoreOutput(self.request_id, [], finished=True, finish_reason="abort",
                                    num_prompt_tokens=self.request.num_prompt_tokens,
                                    num_output_tokens=self.request.num_output_tokens)
        assert self.command is not None
        return EngineCoreOutput(self.request_id, [], finished=True, finish_reason="abort",
                                num_prompt_tokens=len(self.command.prompt_token_ids))


class ParkedRequests:
    """By the client's request id. Not thread-safe: the engine thread alone touches it."""

    def __init__(self) -> None:
        self._by_id: dict[str, Parked] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def park_moved(self, request: Request, deadline: float) -> None:
        self._by_id[request.request_id] = Parked(request.request_id, deadline,
                                                 request.arrival_time, request=request)

    def park_new(self, command: AddRequest, deadline: float) -> None:
        self._by_id[command.request_id] = Parked(command.request_id, deadline,
                                                 time.monotonic(), command=command)

    def take(self, request_id: str) -> Parked | None:
        return self._by_id.pop(request_id, None)

    def put_back(self, parked: Parked) -> None:
        self._by_id[parked.request_id] = parked

    def in_order(self) -> list[Parked]:
        """Oldest first: requests that were running before new ones."""
        return sorted(self._by_id.values(), key=lambda p: p.arrival)

    def take_expired(self, now: float) -> list[Parked]:
        expired = [p for p in self.in_order() if p.deadline <= now]
        for p in expired:
            del self._by_id[p.request_id]
        return expired

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._by_id.values()), default=None)

    def take_all(self) -> list[Parked]:
        parked, self._by_id = self.in_order(), {}
        return parked
