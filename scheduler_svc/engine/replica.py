"""One replica of the replicated engine: an EngineCore stepped call by call, each call made only
once the worker's reply it reads is in, so that a replica whose worker is slow or cut off holds
up no other replica.

A step's calls are EngineCore's (launch_step, apply_in_flight, sample_step, finish_step), in
their order; between two of them the replica may wait for its worker over several rounds of the
engine loop while the other replicas step. A replica whose worker stops answering keeps its step
where it was until the reply comes or the executor's watcher declares the group failed (missed
heartbeats); the replicated engine then moves its requests, as for any failure.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.engine.engine_core import EngineCore, StepInFlight
from scheduler_svc.executors.replies import reply_ready

# While several replicas wait for their workers, the engine looks at each reply this often: the
# longest a reply that came waits to be read (a lone reply is waited for in one call).
POLL_S = 0.001
# The longest one wait lasts before the engine looks at its inbox (a new request, an abort).
INBOX_POLL_S = 0.05


@dataclasses.dataclass(eq=False)
class Replica:
    replica_id: str
    core: EngineCore
    draining: bool = False
    drain_deadline: float = float("inf")
    left: Future | None = None  # resolved once the replica is gone, for whoever detached it
    launched: StepInFlight | None = None  # launched, not yet finished: waits for its worker

    @property
    def load(self) -> int:
        return len(self.core.requests)

    @property
    def failed(self) -> bool:
        return self.core.executor.failed

    def busy(self) -> bool:
        return self.core.has_requests() or self.launched is not None

    def awaited_reply(self) -> Any:
        """The worker's reply that this replica's next call reads, while it is not in; None when
        the next call can be made now (or there is none)."""
        step, core = self.launched, self.core
        if step is None:
            reply = core.in_flight.sampled if core.in_flight is not None else None
        elif step.sampled is None:
            reply = step.forward
        else:  # synchronous: finish_step reads the tokens; async: it only keeps the step
            reply = None if core.async_scheduling else step.sampled
        return None if reply is None or reply_ready(reply) else reply

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Makes the calls of this replica's step whose replies are in, adding the requests'
        outputs to `outputs` as they are made; raises WorkerUnavailableError when its group
        failed. Outputs made before a failure are in `outputs` by then: async, a call applies
        the step before's tokens to the requests before the next reply is read, and a token
        applied there moves with its request, so its client must get it."""
        core = self.core
        step = self.launched
        if step is None:
            if self.awaited_reply() is not None or not core.has_requests():
                return
            step = core.launch_step()
            outputs += core.apply_in_flight()  # async: the step before's tokens, while it runs
            if step is None:
                return
            self.launched = step
        if step.sampled is None:
            if self.awaited_reply() is not None:
                return
            core.sample_step(step)
        if self.awaited_reply() is not None:
            return
        self.launched = None
        outputs += core.finish_step(step)


def wait_for_a_reply(replicas: Sequence[Replica], interrupted: Callable[[], bool]) -> None:
    """Returns once some replica can make its next call, or at once when one can already, none
    waits, or interrupted() (a command came)."""
    replies = []
    for replica in replicas:
        reply = replica.awaited_reply()
        if reply is None:
            if replica.launched is not None or replica.core.has_requests():
                return  # this one goes on now
            continue  # idle
        replies.append(reply)
    if not replies:
        return
    slice_s = INBOX_POLL_S if len(replies) == 1 else POLL_S
    deadline = time.monotonic() + INBOX_POLL_S
    while not interrupted():
        for reply in replies:
            if reply_ready(reply, slice_s):
                return
        if time.monotonic() > deadline:
            return  # the caller's loop looks at its replicas and inbox, and comes back
