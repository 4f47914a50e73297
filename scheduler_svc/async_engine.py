"""The engine loop on a thread of its own, feeding one asyncio stream per request.

EngineCore is not thread-safe, so only the engine thread touches it. The event loop sends it
commands (add, abort) through a queue; the thread applies them between steps and hands each
step's outputs back to the loop in one call_soon_threadsafe. A stream closed before its request
finished (the client cancelled, its deadline passed) aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from scheduler_svc.engine_core import EngineCore
from scheduler_svc.outputs import EngineCoreOutput
from scheduler_svc.replicas import ReplicatedEngine
from scheduler_svc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestIdInUseError(ValueError):
    """An active request already has this id."""


class NotAdmittingError(RuntimeError):
    """The server is draining: in-flight requests finish, new ones are refused."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error (a worker failed); no request can run."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """The scheduler's state after the latest step, read by the event loop without a lock."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0  # usable blocks: the null block is not counted
    kv_blocks_used: int = 0  # held by unfinished requests; free cached blocks are not
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class RequestStream:
    """One request's outputs, in order. Iterating merges whatever has queued up since the last
    read into one delta, so a slow reader gets fewer, larger messages rather than a backlog."""

    def __init__(self, engine: AsyncEngine, request_id: str, key: str) -> None:
        self.request_id = request_id  # the client's id
        self.key = key  # the engine's id for this request: unique even when a client reuses ids
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finished = False  # the engine sends nothing more: finished, failed or closed
        self._exhausted = False  # the reader has seen the last item
        self._engine = engine
        self._queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self._exhausted:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, EngineCoreOutput) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            item = nxt if isinstance(nxt, BaseException) else _merge(item, nxt)
        if isinstance(item, BaseException):
            self._exhausted = True
            raise item
        self._exhausted = item.finished
        return item

    def close(self) -> None:
        """Aborts the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine._forget(self, abort=True)

    def _push(self, item: EngineCoreOutput | BaseException) -> None:
        if isinstance(item, EngineCoreOutput):
            if item.new_token_ids and self.first_token_time is None:
                self.first_token_time = time.monotonic()
            self.finished = item.finished
        else:
            self.finished = True
        self._queue.put_nowait(item)


def _merge(a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
    logprobs = None
    if a.new_logprobs or b.new_logprobs:
        logprobs = (a.new_logprobs or []) + (b.new_logprobs or [])
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids,
                               new_text=a.new_text + b.new_text, new_logprobs=logprobs)


class AsyncEngine:
    """`observer`, when given, is called on the event loop with each finished stream and its last
    output, and on the engine thread with the EngineStats of each step (metrics)."""

    def __init__(self, core: EngineCore | ReplicatedEngine, observer: Any = None) -> None:
        self.core = core
        self.observer = observer
        self.stats = EngineStats()
        self.admitting = True
        self.dead: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None  # called on the event loop
        self._streams: dict[str, RequestStream] = {}  # by engine key
        self._keys: dict[str, str] = {}  # client id -> engine key, for active requests
        self._keygen = itertools.count()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        if isinstance(core, ReplicatedEngine):  # a replica joining or leaving wakes the loop
            core.wake = self._wake.set
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # Life cycle.

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stops the thread (after the step in progress) and releases the workers."""
        self._send(("stop",))
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.core.shutdown()

    def stop_admitting(self) -> None:
        self.admitting = False

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def wait_until_idle(self) -> None:
        await self._idle.wait()

    # Requests.

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admits a request and returns its stream; raises what admission refuses it for."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if not self.admitting:
            raise NotAdmittingError("the server is draining and admits no new request")
        if request_id in self._keys:
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        stream = RequestStream(self, request_id, f"{next(self._keygen)}-{request_id}")
        self._streams[stream.key] = stream
        self._keys[request_id] = stream.key
        self._idle.clear()
        admitted: Future = Future()
        self._send(("add", stream.key, list(prompt_token_ids), params, priority, cache_salt,
                    admitted))
        try:
            await asyncio.wrap_future(admitted)
        except BaseException:
            # Refused, or the caller went away while waiting: forget it (and abort it in case
            # the engine admitted it in the meantime).
            stream.finished = True
            self._forget(stream, abort=True)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Aborts active requests by client id; their streams end with finish_reason "abort".
        Returns the ids that were active."""
        keys = [self._keys[i] for i in request_ids if i in self._keys]
        if keys:
            self._send(("abort", keys))
        return [i for i in request_ids if i in self._keys]

    def _forget(self, stream: RequestStream, abort: bool) -> None:
        if self._streams.pop(stream.key, None) is None:
            return
        if self._keys.get(stream.request_id) == stream.key:
            del self._keys[stream.request_id]
        if abort:
            self._send(("abort", [stream.key]))
        if not self._streams:
            self._idle.set()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # The engine thread.

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if not self._apply_commands():
                    return
                if not self.core.has_requests():
                    self._wake.wait()
                    continue
                try:
                    outputs = self.core.step()
                except Exception as e:
                    lost = getattr(e, "request_ids", None)
                    if lost is None:
                        raise
                    # Some requests lost their worker replica; the others go on (replicas.py).
                    outputs = list(getattr(e, "outputs", ()))
                    self._call_soon(self._fail, lost, e)
                self._publish_stats()
                if outputs:
                    self._call_soon(self._deliver, outputs)
        except Exception as e:  # a worker failed: every request, present and future, fails
            logger.exception("the engine loop stopped")
            self._fail_pending(e)
            self._call_soon(self._die, e)

    def _apply_commands(self) -> bool:
        """Adds and aborts requests between steps; False once told to stop."""
        aborted = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "abort":
                aborted.extend(self.core.abort_requests(command[1]))
            elif kind == "add":
                _, key, ids, params, priority, cache_salt, admitted = command
                try:
                    self.core.add_request(ids, params, client_id=key, priority=priority,
                                          cache_salt=cache_salt)
                except Exception as e:
                    admitted.set_exception(e)
                else:
                    admitted.set_result(None)
        if aborted:
            self._publish_stats()
            self._call_soon(self._deliver, aborted)
        return True

    def _fail_pending(self, error: Exception) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[-1].set_exception(EngineDeadError(f"the engine stopped: {error}"))

    def _publish_stats(self) -> None:
        """Sums over the schedulers: one, or one per worker replica (a ReplicatedEngine)."""
        replicas = getattr(self.core, "replicas", None)
        schedulers = [r.scheduler for r in replicas] if replicas is not None else [
            self.core.scheduler]
        total = sum(s.kv.pool.num_blocks - 1 for s in schedulers)
        self.stats = EngineStats(
            num_running=sum(len(s.running) for s in schedulers),
            num_waiting=sum(len(s.waiting) for s in schedulers),
            kv_blocks_total=total,
            kv_blocks_used=total - sum(s.kv.pool.num_free_blocks for s in schedulers),
            num_steps=sum(s.stats.num_steps for s in schedulers),
            num_preemptions=sum(s.stats.num_preemptions for s in schedulers),
            num_prefix_queries=sum(s.stats.num_prefix_queries for s in schedulers),
            num_prefix_hits=sum(s.stats.num_prefix_hits for s in schedulers))
        if self.observer is not None:
            self.observer.observe_engine(self.stats)

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the server is gone and nobody is listening

    # Back on the event loop.

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # its client went away
            stream._push(out)
            if out.finished:
                self._forget(stream, abort=False)
                if self.observer is not None:
                    self.observer.observe_finished(stream, out)

    def _fail(self, keys: list[str], error: Exception) -> None:
        """Ends these requests' streams with the error (the engine itself goes on)."""
        for key in keys:
            stream = self._streams.get(key)
            if stream is not None:
                stream._push(error)
                self._forget(stream, abort=False)

    def _die(self, error: Exception) -> None:
        self.dead = error
        dead = EngineDeadError(f"the engine stopped: {error}")
        for stream in list(self._streams.values()):
            stream._push(dead)
            self._forget(stream, abort=False)
        if self.on_dead is not None:
            self.on_dead(error)
