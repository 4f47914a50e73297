"""Data parallelism: one engine driving several worker groups (replicas), each an EngineCore with
a scheduler and so a KV block manager of its own.

A new request goes to the least loaded replica (fewest unfinished requests; ties go to the one
holding more of its prompt in its prefix cache). The replicas step independently (replica.py):
each round of the loop makes, for every replica, the calls of its step whose worker replies are
in, and waits only when no replica can go on, for whichever reply comes first. So the replicas
compute side by side, and one whose worker is slow or cut off delays no other's tokens until its
group is declared failed (missed heartbeats) and its requests move.

Replicas come and go while the engine runs: attach() and detach() may be called from any thread
(a registration RPC, a pod watch); like every command they go through the inbox and the engine
thread applies them between steps. A detached (draining) replica takes no new requests: its
waiting ones move to the others at once, its running ones finish there or, after
drain_timeout_s, move too. A replica whose workers fail is dropped at once and its requests move:
each is re-queued on a survivor with its prompt and the tokens already streamed, recomputed there,
so the stream goes on with no gap and no duplicate, and with the tokens of an undisturbed run: the
new worker counts the earlier tokens as output (penalties, min_tokens) and moves a seeded
generator past their draws. With no replica to take them, requests fail with NoReplicaError,
which a service answers with UNAVAILABLE; the engine itself stays usable for replicas that join
later. With a grace period (config.worker_grace_s) they wait for one instead (parked.py): those
whose replica died or left up to the grace period, and new requests that arrive within the
grace period after the last live replica was lost (up to max_queued_requests of them); the first
replica that joins (or returns: a frozen worker registers again) takes them, moved like onto a
survivor. Only then do they fail with NoReplicaError.

Apart from the inbox, not thread-safe: one thread adds, aborts and steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.errors import InvalidRequestError, QueueFullError, RequestIdInUseError
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.commands import (
    AbortRequests,
    AddRequest,
    AttachReplica,
    Command,
    DetachReplica,
    Inbox,
    StopRequests,
    answer,
    refuse,
    take_on,
)
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.parked import Parked, ParkedRequests
from scheduler_svc.engine.replica import Replica, wait_for_a_reply
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import WorkerUnavailableError

logger = logging.getLogger(__name__)

# While a grace period is on, the idle engine looks at its replicas this often, so that the grace
# period after the last one is lost starts when it is lost, not at the next request.
LIVENESS_POLL_S = 0.25


NO_WORKER = ("no worker is available to run the request: none has joined yet, or every one "
             "failed or is leaving")


class NoReplicaError(WorkerUnavailableError):
    """Requests that no replica can run. `outputs` are the step's results for the other
    requests, still to be delivered when step() raises this."""

    def __init__(self, message: str, request_ids: Sequence[str] = (),
                 outputs: Sequence[EngineCoreOutput] = ()) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.outputs = list(outputs)


class ReplicatedEngine:
    def __init__(self, config: SchedulerConfig, executors: Sequence[Executor] | None = None,
                 tokenizer: Any = None, drain_timeout_s: float = 120.0) -> None:
        """executors: the connected groups; None connects those of the config (or starts one),
        an empty list starts with none and waits for attach()."""
        self.config = config
        self.tokenizer = tokenizer
        self.drain_timeout_s = drain_timeout_s
        self.replicas: list[Replica] = []
        self.inbox = Inbox()
        self._replica_ids = itertools.count()
        self.num_moved = 0  # requests re-queued on another replica, for metrics and tests
        self.grace_s = config.worker_grace_s
        self.parked = ParkedRequests()  # waiting for a replica, within the grace period
        self._unserved_since: float | None = None  # when the last live replica was lost
        for executor in self._connect_configured() if executors is None else executors:
            self.add_replica(EngineCore(config, executor, tokenizer))

    @classmethod
    def over(cls, core: EngineCore, drain_timeout_s: float = 120.0) -> ReplicatedEngine:
        """A replicated engine whose one replica is an existing engine core."""
        engine = cls(core.config, [], core.scheduler.tokenizer, drain_timeout_s)
        engine.add_replica(core)
        return engine

    def _connect_configured(self) -> list[Executor]:
        cls = Executor.get_class(self.config)
        groups = self.config.worker_addresses
        if not groups:
            return [cls(self.config)]
        return [cls.connect(self.config, [a.strip() for a in g.split(",")]) for g in groups]


    def attach(self, executor: Executor, replica_id: str | None = None) -> Future:
        """Adds a connected worker group; the future resolves to its replica id once it takes
        requests (at the engine's next step)."""
        command = AttachReplica(executor, replica_id)
        self.inbox.put(command)
        return command.done

    def detach(self, replica_id: str, timeout_s: float | None = None) -> Future:
        """Drains a replica; the future resolves to the numbers of its requests (moved, lost)
        when it left. Within timeout_s (default drain_timeout_s) its running requests may finish
        there; after it they move to other replicas."""
        command = DetachReplica(replica_id, timeout_s)
        self.inbox.put(command)
        return command.done


    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    request_id: str | None = None, **kwargs: Any) -> Request:
        if request_id is not None and (self._replica_of(request_id) is not None
                                       or request_id in self.parked):
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        replica = self._place(prompt_token_ids, kwargs.get("cache_salt"))
        if replica is None:
            raise NoReplicaError(NO_WORKER,
                                 [request_id] if request_id is not None else [])
        return replica.core.add_request(prompt_token_ids, sampling_params,
                                        request_id=request_id, **kwargs)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            parked = self.parked.take(request_id)
            if parked is not None:
                if parked.command is not None:  # admitted, to end at once with "abort"
                    answer(parked.command.admitted)
                outputs.append(parked.abort_output())
                continue
            replica = self._replica_of(request_id)
            if replica is not None:
                outputs += replica.core.abort_requests([request_id])
        return outputs

    def stop_requests(self, stops: dict[str, tuple[int, str]]) -> list[EngineCoreOutput]:
        """Ends requests a stop string ended (EngineCore.stop_requests), wherever they run."""
        outputs = []
        for request_id, stop in stops.items():
            parked = self.parked.take(request_id)
            if parked is not None:  # waiting for a replica: it ends now, not at its deadline
                outputs.append(parked.stop_output(*stop))
                continue
            replica = self._replica_of(request_id)
            if replica is not None:
                outputs += replica.core.stop_requests({request_id: stop})
        return outputs

    def has_requests(self) -> bool:
        return bool(self.parked) or self._has_work()

    def _has_work(self) -> bool:
        return not self.inbox.empty() or any(r.busy() or r.draining for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.load for r in self.replicas) + len(self.parked)

    def idle_wait_s(self) -> float | None:
        """How long a loop may wait (or until woken by a command) before the next step(): 0 when
        there is work to step; while requests only wait for a replica, until the first of them
        is due; with a grace period, LIVENESS_POLL_S; else None, until woken."""
        if self._has_work():
            return 0.0
        deadline = self.parked.next_deadline()
        if deadline is not None:
            return min(max(deadline - time.monotonic(), 0.0), LIVENESS_POLL_S)
        return LIVENESS_POLL_S if self.grace_s > 0 else None

    def step(self) -> list[EngineCoreOutput]:
        outputs = self.apply_commands()
        self._place_parked()
        # A group whose watcher noticed a failure between steps goes before it is sent anything.
        failed = [r for r in self.replicas if r.failed]
        stepping = [r for r in self.replicas if r not in failed]
        wait_for_a_reply(stepping, interrupted=lambda: not self.inbox.empty())
        for replica in stepping:
            try:
                replica.advance(outputs)
            except WorkerUnavailableError as e:
                failed.append(self._log_failure(replica, e))
        lost = []
        for replica in failed:
            outputs += replica.core.take_refused()  # refused before it failed: they end anyway
            lost += self._remove(replica, reason="failed")
        lost += self._progress_drains()
        self._note_liveness()
        lost += self._expire_parked()
        if lost:
            raise NoReplicaError(f"no worker replica left to run {len(lost)} request(s)"
                                 + (f" within the grace period of {self.grace_s:g} s"
                                    if self.grace_s > 0 else ""), lost, outputs)
        return outputs

    def apply_commands(self) -> list[EngineCoreOutput]:
        """Applies what the inbox holds; returns the outputs of the requests it aborted."""
        # A failed group holding no request can go now: nothing of it is lost.
        for replica in [r for r in self.replicas if r.failed and not r.core.requests]:
            self._remove(replica, reason="failed")
        outputs: list[EngineCoreOutput] = []
        for command in self.inbox.drain():
            outputs += self._apply(command)
        self._note_liveness()
        return outputs

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.core.shutdown()
        self.replicas.clear()

    def fail_parked(self, error: Exception) -> list[str]:
        """Ends every wait (the engine stops): new requests are refused with `error`; returns the
        ids of the moved ones, whose streams the caller ends."""
        moved = []
        for parked in self.parked.take_all():
            if parked.command is not None:
                refuse(parked.command.admitted, error)
            else:
                moved.append(parked.request_id)
        return moved


    def _apply(self, command: Command) -> list[EngineCoreOutput]:
        if isinstance(command, AbortRequests):
            return self.abort_requests(command.request_ids)
        if isinstance(command, StopRequests):
            return self.stop_requests(command.stops)
        try:
            if isinstance(command, AddRequest):
                if not take_on(command):
                    return []  # its caller went away before admission: nothing to admit
                try:
                    self._admit(command)
                except NoReplicaError:
                    if not self._park_new(command):
                        raise
            elif isinstance(command, AttachReplica):
                core = EngineCore(self.config, command.executor, self.tokenizer)
                answer(command.done, self.add_replica(core, command.replica_id).replica_id)
            else:
                self._start_drain(command)
        except Exception as e:
            refuse(command.admitted if isinstance(command, AddRequest) else command.done, e)
        return []


    def _admit(self, command: AddRequest) -> None:
        self.add_request(command.prompt_token_ids, command.params,
                         request_id=command.request_id, priority=command.priority,
                         cache_salt=command.cache_salt, pooling=command.pooling,
                         lora=command.lora)
        answer(command.admitted)


    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining and not r.failed]

    def _note_liveness(self) -> None:
        if self._live():
            self._unserved_since = None
        elif self._unserved_since is None:
            self._unserved_since = time.monotonic()

    def _park_new(self, command: AddRequest) -> bool:
        """Parks a new request that no replica can take, within the grace period after the last
        live one was lost; False when it must be refused now. Raises QueueFullError when
        max_queued_requests already wait."""
        self._note_liveness()
        if self.grace_s <= 0 or self._unserved_since is None:
            return False
        deadline = self._unserved_since + self.grace_s
        if time.monotonic() >= deadline:
            return False
        if len(self.parked) >= self.config.max_queued_requests:
            raise QueueFullError(f"{len(self.parked)} requests are waiting for a worker replica, "
                                 f"the limit is {self.config.max_queued_requests}")
        self.parked.park_new(command, deadline)
        return True

    def _place_parked(self) -> None:
        """Hands waiting requests, the oldest first, to the replicas that can take them."""
        if not self.parked or not self._live():
            return
        placed = 0
        for parked in self.parked.in_order():
            self.parked.take(parked.request_id)  # its id is no longer in use while it is placed
            if self._place_one(parked):
                placed += 1
            else:
                self.parked.put_back(parked)
        if placed:
            logger.info("%d waiting request(s) placed; %d still wait", placed, len(self.parked))

    def _place_one(self, parked: Parked) -> bool:
        if parked.request is not None:
            target = self._place(parked.request.all_token_ids, parked.request.cache_salt)
            if target is None:
                return False
            try:
                self._requeue(parked.request, target)
            except (InvalidRequestError, QueueFullError):
                return False  # another replica may take it before its deadline
            self.num_moved += 1
            return True
        assert parked.command is not None
        try:
            self._admit(parked.command)
        except NoReplicaError:
            return False
        except (InvalidRequestError, QueueFullError, RequestIdInUseError) as e:
            refuse(parked.command.admitted, e)  # refused as at once, with its reason
        return True

    def _expire_parked(self) -> list[str]:
        """Ends the waits that are due: new requests are refused, the moved ones' ids returned."""
        lost = []
        for parked in self.parked.take_expired(time.monotonic()):
            if parked.command is not None:
                refuse(parked.command.admitted, NoReplicaError(
                    f"no worker replica joined within the grace period of {self.grace_s:g} s",
                    [parked.request_id]))
            else:
                lost.append(parked.request_id)
        if lost:
            logger.warning("%d request(s) waited %g s for a worker replica in vain", len(lost),
                           self.grace_s)
        return lost

    def _replica_of(self, request_id: str) -> Replica | None:
        return next((r for r in self.replicas if request_id in r.core.requests), None)

    def _place(self, token_ids: Sequence[int], cache_salt: str | None,
               exclude: Replica | None = None) -> Replica | None:
        candidates = [r for r in self.replicas
                      if not r.draining and r is not exclude and not r.failed]
        if not candidates:
            return None
        least = min(r.load for r in candidates)
        tied = [r for r in candidates if r.load == least]
        if len(tied) == 1:
            return tied[0]
        return max(tied, key=lambda r: _prefix_hits(r.core, token_ids, cache_salt))

    def move_request(self, request: Request, source: Replica) -> bool:
        """Re-queues an unfinished request on another replica with everything it has done: its
        output tokens and its grammar matcher (scheduler.add_request); its text stays with the
        caller's output processor."""
        target = self._place(request.all_token_ids, request.cache_salt, exclude=source)
        if target is None:
            return False
        try:
            self._requeue(request, target)
        except (InvalidRequestError, QueueFullError) as e:
            logger.warning("request %s cannot move to replica %s: %s", request.request_id,
                           target.replica_id, e)
            return False
        self.num_moved += 1
        return True

    @staticmethod
    def _requeue(request: Request, target: Replica) -> None:
        target.core.add_request(
            request.prompt_token_ids, request.sampling_params, request_id=request.request_id,
            arrival_time=request.arrival_time, priority=request.priority,
            cache_salt=request.cache_salt, grammar=request.grammar,
            output_token_ids=request.output_token_ids, pooling=request.pooling,
            lora=request.lora)

    def add_replica(self, core: EngineCore, replica_id: str | None = None) -> Replica:
        info = core.info
        if self.replicas:
            first = self.replicas[0].core.info
            if (info.model_name, info.vocab_size) != (first.model_name, first.vocab_size):
                raise ValueError(f"replica serves {info.model_name!r} (vocabulary "
                                 f"{info.vocab_size}), the others {first.model_name!r} "
                                 f"({first.vocab_size})")
        replica_id = replica_id or f"replica-{next(self._replica_ids)}"
        if any(r.replica_id == replica_id for r in self.replicas):
            raise ValueError(f"replica id {replica_id!r} is already in use")
        core.output_processor = None  # stepped call by call, token-level: the caller's text
        replica = Replica(replica_id, core)
        self.replicas.append(replica)
        logger.info("replica %s joined: %d KV blocks", replica_id, info.num_blocks)
        return replica

    def _start_drain(self, command: DetachReplica) -> None:
        replica = next((r for r in self.replicas if r.replica_id == command.replica_id), None)
        if replica is None:
            raise KeyError(f"no replica {command.replica_id!r}")
        replica.draining = True
        replica.left = command.done
        timeout = self.drain_timeout_s if command.timeout_s is None else command.timeout_s
        replica.drain_deadline = time.monotonic() + timeout
        # Requests that have not started lose nothing by moving now.
        waiting = [r for r in replica.core.requests.values() if r.num_computed_tokens == 0]
        for request in waiting:
            if self.move_request(request, replica):
                replica.core.remove_request(request)

    def _progress_drains(self) -> list[str]:
        lost = []
        now = time.monotonic()
        for replica in [r for r in self.replicas if r.draining]:
            if replica.busy() and now < replica.drain_deadline:
                continue
            lost += self._remove(replica, reason="left")
        return lost

    def _remove(self, replica: Replica, reason: str) -> list[str]:
        """Takes the replica out; its unfinished requests move, or wait for a replica within
        the grace period. Returns those that could do neither."""
        self.replicas.remove(replica)
        requests = sorted(replica.core.requests.values(), key=lambda r: r.arrival_time)
        lost = []
        moved = 0
        deadline = time.monotonic() + self.grace_s
        for request in requests:
            if self.move_request(request, replica):
                moved += 1
            elif self.grace_s > 0:
                self.parked.park_moved(request, deadline)
            else:
                lost.append(request.request_id)
        waiting = len(requests) - moved - len(lost)
        logger.info("replica %s %s: %d request(s) moved, %d wait for a replica (%g s), %d lost",
                    replica.replica_id, reason, moved, waiting, self.grace_s, len(lost))
        try:
            replica.core.shutdown()
        except Exception:  # a failed group may not even close cleanly
            logger.exception("closing replica %s", replica.replica_id)
        if replica.left is not None:
            answer(replica.left, (moved, len(lost)))
        return lost

    def _log_failure(self, replica: Replica, error: Exception) -> Replica:
        logger.error("replica %s failed: %s", replica.replica_id, error)
        return replica


def _prefix_hits(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None) -> int:
    probe = Request("probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
    return core.scheduler.kv.get_computed_blocks(probe)[1]
