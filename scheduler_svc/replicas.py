"""Data parallelism: one engine driving several worker groups (replicas), each with a scheduler
and so a KV block manager of its own.

A new request goes to the least loaded replica (fewest unfinished requests; ties go to the one
holding more of its prompt in its prefix cache). Each step, every replica with work schedules and
sends its forward pass before any result is read, so the replicas compute side by side.

Replicas come and go while the engine runs. attach() and detach() may be called from any thread
(a registration RPC); the engine thread applies them between steps. A detached (draining) replica
takes no new requests: its waiting ones move to the others at once, its running ones finish there
or, after drain_timeout_s, move too. A replica whose workers fail is dropped at once and its
requests move: each is re-queued on a survivor with its prompt and the tokens already streamed,
recomputed there, so the stream goes on with no gap and no duplicate, and with the tokens of an
undisturbed run: the new worker counts the earlier tokens as output (penalties, min_tokens) and
moves a seeded generator past their draws.
With no replica to take them, requests fail with NoReplicaError, which a service answers with
UNAVAILABLE; the engine itself stays usable for replicas that join later.

Like EngineCore, not thread-safe apart from attach() and detach(): one thread adds, aborts, steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.errors import InvalidRequestError, QueueFullError
from scheduler_svc.executor import Executor
from scheduler_svc.outputs import EngineCoreOutput
from scheduler_svc.request import Request
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.worker_errors import WorkerUnavailableError

logger = logging.getLogger(__name__)


class NoReplicaError(WorkerUnavailableError):
    """Requests that no replica can run. `outputs` are the step's results for the other
    requests, still to be delivered when step() raises this."""

    def __init__(self, message: str, request_ids: Sequence[str] = (),
                 outputs: Sequence[EngineCoreOutput] = ()) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.outputs = list(outputs)


@dataclasses.dataclass(eq=False)
class Replica:
    replica_id: str
    executor: Executor
    scheduler: Scheduler
    info: worker_pb2.WorkerInfo
    draining: bool = False
    drain_deadline: float = float("inf")
    left: Future | None = None  # resolved once the replica is gone, for whoever detached it

    @property
    def load(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


class ReplicatedEngine:
    def __init__(self, config: SchedulerConfig, executors: Sequence[Executor] | None = None,
                 tokenizer: Any = None, drain_timeout_s: float = 120.0) -> None:
        """executors: the connected groups; None connects those of the config (or starts one),
        an empty list starts with none and waits for attach()."""
        self.config = config
        self.tokenizer = tokenizer
        self.drain_timeout_s = drain_timeout_s
        self.replicas: list[Replica] = []
        self._owner: dict[str, Replica] = {}  # client id -> the replica running it
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self.num_moved = 0  # requests re-queued on another replica, for metrics and tests
        # Called (from the calling thread) after attach() or detach() queued a change, so that a
        # loop waiting for requests wakes up and applies it: an idle engine would not step.
        self.wake: Callable[[], None] | None = None
        for executor in self._connect_configured() if executors is None else executors:
            self._add_replica(executor)

    def _connect_configured(self) -> list[Executor]:
        cls = Executor.get_class(self.config)
        groups = self.config.worker_addresses
        if not groups:
            return [cls(self.config)]
        return [cls(self.config, [a.strip() for a in g.split(",")])  # type: ignore[call-arg]
                for g in groups]

    # -- membership, from any thread ------------------------------------------------------------

    def attach(self, executor: Executor, replica_id: str | None = None) -> Future:
        """Adds a connected worker group; the future resolves to its replica id once it takes
        requests (at the engine's next step)."""
        done: Future = Future()
        self._commands.put(("attach", executor, replica_id, done))
        if self.wake is not None:
            self.wake()
        return done

    def detach(self, replica_id: str, timeout_s: float | None = None) -> Future:
        """Drains a replica; the future resolves to the numbers of its requests (moved, lost)
        when it left. Within timeout_s (default drain_timeout_s) its running requests may finish
        there; after it they move to other replicas."""
        done: Future = Future()
        self._commands.put(("detach", replica_id, timeout_s, done))
        if self.wake is not None:
            self.wake()
        return done

    # -- the engine interface (one thread) ------------------------------------------------------

    @property
    def worker_info(self) -> worker_pb2.WorkerInfo | None:
        return self.replicas[0].info if self.replicas else None

    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    client_id: str | None = None, **kwargs: Any) -> Request:
        self._apply_commands()
        client_id = client_id if client_id is not None else f"dp-{next(self._ids)}"
        if client_id in self._owner:
            raise InvalidRequestError("request_id", f"{client_id!r} is already running")
        replica = self._place(prompt_token_ids, kwargs.get("cache_salt"))
        if replica is None:
            raise NoReplicaError("no worker replica is available", [client_id])
        request = replica.scheduler.add_request(prompt_token_ids, sampling_params,
                                                client_id=client_id, **kwargs)
        self._owner[client_id] = replica
        return request

    def abort_requests(self, client_ids: Iterable[str]) -> list[EngineCoreOutput]:
        by_replica: dict[int, tuple[Replica, list[str]]] = {}
        for client_id in client_ids:
            replica = self._owner.get(client_id)
            if replica is not None:
                by_replica.setdefault(id(replica), (replica, []))[1].append(client_id)
        outputs = []
        for replica, ids in by_replica.values():
            outputs += self._patch(replica.scheduler.abort_requests(ids))
        return outputs

    def has_requests(self) -> bool:
        return not self._commands.empty() or any(r.scheduler.has_requests() or r.draining
                                                  for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    def step(self) -> list[EngineCoreOutput]:
        self._apply_commands()
        # A group whose watcher noticed a failure between steps goes before it is sent anything.
        failed = [r for r in self.replicas if getattr(r.executor, "failed", False)]
        launched = []
        for replica in self.replicas:
            if replica in failed or not replica.scheduler.has_requests():
                continue
            so = replica.scheduler.schedule()
            try:
                launched.append((replica, so, replica.executor.execute_model(so, non_block=True)))
            except WorkerUnavailableError as e:
                failed.append(self._log_failure(replica, e))
        sampled = []
        for replica, so, future in launched:
            grammar = replica.scheduler.get_grammar_bitmask(so)  # beside the forward passes
            try:
                out = future.result()
                if out is None:
                    out = replica.executor.collective_rpc(
                        "sample_tokens", (grammar,), non_block=True, unique_reply_rank=0)
                sampled.append((replica, so, out))
            except WorkerUnavailableError as e:
                failed.append(self._log_failure(replica, e))
        outputs: list[EngineCoreOutput] = []
        for replica, so, out in sampled:
            try:
                if isinstance(out, Future):
                    out = out.result()
            except WorkerUnavailableError as e:
                failed.append(self._log_failure(replica, e))
                continue
            outputs += replica.scheduler.update_from_output(so, out)
        outputs = self._patch(outputs)
        lost = []
        for replica in failed:
            lost += self._remove(replica, reason="failed")
        lost += self._progress_drains()
        if lost:
            raise NoReplicaError(f"no worker replica left to run {len(lost)} request(s)", lost,
                                 outputs)
        return outputs

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.executor.shutdown()
        self.replicas.clear()

    # -- placement and moves --------------------------------------------------------------------

    def _place(self, token_ids: Sequence[int], cache_salt: str | None,
               exclude: Replica | None = None) -> Replica | None:
        candidates = [r for r in self.replicas if not r.draining and r is not exclude
                      and not getattr(r.executor, "failed", False)]
        if not candidates:
            return None
        least = min(r.load for r in candidates)
        tied = [r for r in candidates if r.load == least]
        if len(tied) == 1:
            return tied[0]
        return max(tied, key=lambda r: _prefix_hits(r.scheduler, token_ids, cache_salt))

    def move_request(self, request: Request, source: Replica) -> bool:
        """Re-queues an unfinished request on another replica with everything it has done: its
        output tokens, its detokenizer and its grammar matcher (scheduler.add_request)."""
        client_id = request.client_id
        target = self._place(request.all_token_ids, request.cache_salt, exclude=source)
        if target is None:
            return False
        try:
            target.scheduler.add_request(
                request.prompt_token_ids, request.sampling_params, client_id=client_id,
                arrival_time=request.arrival_time, priority=request.priority,
                cache_salt=request.cache_salt, grammar=request.grammar,
                output_token_ids=request.output_token_ids, detokenizer=request.detokenizer)
        except (InvalidRequestError, QueueFullError) as e:
            logger.warning("request %s cannot move to replica %s: %s", client_id,
                           target.replica_id, e)
            return False
        self._owner[client_id] = target
        self.num_moved += 1
        return True

    def _patch(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Forgets the owners of finished requests."""
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    # -- replicas joining, draining, failing ----------------------------------------------------

    def _add_replica(self, executor: Executor, replica_id: str | None = None) -> Replica:
        info = executor.get_info()
        if self.replicas:
            first = self.replicas[0].info
            if (info.model_name, info.vocab_size) != (first.model_name, first.vocab_size):
                raise ValueError(f"replica serves {info.model_name!r} (vocabulary "
                                 f"{info.vocab_size}), the others {first.model_name!r} "
                                 f"({first.vocab_size})")
        eos = set(info.eos_token_ids)
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None:
            eos.add(tokenizer_eos)
        scheduler = Scheduler(self.config, num_blocks=info.num_blocks, block_size=info.block_size,
                              vocab_size=info.vocab_size, eos_token_ids=eos,
                              max_model_len=info.max_model_len or None,
                              max_num_seqs=info.max_num_reqs or None, tokenizer=self.tokenizer)
        replica_id = replica_id or f"replica-{next(self._ids)}"
        if any(r.replica_id == replica_id for r in self.replicas):
            raise ValueError(f"replica id {replica_id!r} is already in use")
        replica = Replica(replica_id, executor, scheduler, info)
        self.replicas.append(replica)
        logger.info("replica %s joined: %d KV blocks", replica_id, info.num_blocks)
        return replica

    def _apply_commands(self) -> None:
        # A failed group holding no request can go now: nothing of it is lost.
        for replica in [r for r in self.replicas if getattr(r.executor, "failed", False)]:
            if not replica.scheduler.requests:
                self._remove(replica, reason="failed")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "attach":
                _, executor, replica_id, done = command
                try:
                    done.set_result(self._add_replica(executor, replica_id).replica_id)
                except Exception as e:
                    done.set_exception(e)
                continue
            _, replica_id, timeout_s, done = command
            leaving = next((r for r in self.replicas if r.replica_id == replica_id), None)
            if leaving is None:
                done.set_exception(KeyError(f"no replica {replica_id!r}"))
                continue
            self._start_drain(leaving, timeout_s, done)

    def _start_drain(self, replica: Replica, timeout_s: float | None, done: Future) -> None:
        replica.draining = True
        replica.left = done
        timeout = self.drain_timeout_s if timeout_s is None else timeout_s
        replica.drain_deadline = time.monotonic() + timeout
        # Requests that have not started lose nothing by moving now.
        waiting = [r for r in replica.scheduler.requests.values() if r.num_computed_tokens == 0]
        for request in waiting:
            if self.move_request(request, replica):
                self._forget(replica, request)

    def _progress_drains(self) -> list[str]:
        lost = []
        now = time.monotonic()
        for replica in [r for r in self.replicas if r.draining]:
            if replica.scheduler.has_requests() and now < replica.drain_deadline:
                continue
            lost += self._remove(replica, reason="left")
        return lost

    def _forget(self, replica: Replica, request: Request) -> None:
        """Drops a request that moved away from a live replica. Its abort output is nobody's
        business: the client's request goes on elsewhere."""
        replica.scheduler.abort_requests([request.client_id])

    def _remove(self, replica: Replica, reason: str) -> list[str]:
        """Takes the replica out; its unfinished requests move. Returns those that could not."""
        self.replicas.remove(replica)
        requests = sorted(replica.scheduler.requests.values(), key=lambda r: r.arrival_time)
        lost = []
        moved = 0
        for request in requests:
            if self.move_request(request, replica):
                moved += 1
            else:
                lost.append(request.client_id)
                self._owner.pop(request.client_id, None)
        logger.info("replica %s %s: %d request(s) moved, %d lost", replica.replica_id, reason,
                    moved, len(lost))
        try:
            replica.executor.shutdown()
        except Exception:  # a failed group may not even close cleanly
            logger.exception("closing replica %s", replica.replica_id)
        if replica.left is not None and not replica.left.done():
            replica.left.set_result((moved, len(lost)))
        return lost

    def _log_failure(self, replica: Replica, error: Exception) -> Replica:
        logger.error("replica %s failed: %s", replica.replica_id, error)
        return replica


def _prefix_hits(scheduler: Scheduler, token_ids: Sequence[int], cache_salt: str | None) -> int:
    probe = Request("probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
    return scheduler.kv.get_computed_blocks(probe)[1]
