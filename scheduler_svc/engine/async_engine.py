"""The engine loop on a thread of its own, feeding one asyncio stream per request.

The engine is not thread-safe, so only the engine thread touches it. The event loop sends it
typed commands (commands.py: add, abort; registration and discovery send attach and detach)
through the engine's inbox; the thread applies them between steps and hands each step's outputs
back to the loop in one call_soon_threadsafe. A stream closed before its request finished (the
client cancelled, its deadline passed) aborts the request, which frees its blocks.

The engine thread's outputs carry token ids only. Their text is made here, on the event loop,
by the same OutputProcessor the offline engine runs inline (core/output_processor.py: the
incremental detokenizer, held-back text, stop strings), so the engine thread never detokenizes.
A stop string ends the stream at once, cut after the token that completed it; the engine hears
of it by a StopRequests command, and whatever it sampled for the request meanwhile is dropped
by the processor, as are the outputs of a stream whose reader went away.

Streams are kept by the client's request id, the one id of a request. A closed stream keeps its
id until the engine has confirmed the request's end (its last output), so that an id reused at
once can never receive the old request's late outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from scheduler_svc.core.errors import RequestIdInUseError, RequestRefusedError
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.commands import (
    AbortRequests,
    AddRequest,
    Command,
    StopRequests,
    refuse,
)
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.replicas import NoReplicaError, ReplicatedEngine

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats", "NotAdmittingError",
           "RequestIdInUseError", "RequestStream"]


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
    num_refused_requests: int = 0  # failed because the worker refused them (step_refusal.py)
    # Speculative decoding, summed over replicas (SchedulerStats has each one's meaning).
    num_spec_requests: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: tuple[int, ...] = ()  # [K]
    accepted_per_position: tuple[int, ...] = ()  # [K]

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class RequestStream:
    """One request's outputs, in order. Iterating merges whatever has queued up since the last
    read into one delta, so a slow reader gets fewer, larger messages rather than a backlog."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id  # the client's id
        self.arrival = time.monotonic()
        self.lora_name = ""  # its LoRA adapter's name, for the metrics; "" = the base model
        self.first_token_time: float | None = None
        self.finished = False  # the engine sends nothing more: finished, failed or closed
        self.closed = False  # its reader went away before its last output
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
            self.finished = self.closed = True
            self._engine._close(self)

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
                               new_text=a.new_text + b.new_text, new_logprobs=logprobs,
                               prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)


class AsyncEngine:
    """`observer`, when given, is called on the event loop with each finished stream and its last
    output, and on the engine thread with the EngineStats of each step (metrics)."""

    def __init__(self, core: EngineCore | ReplicatedEngine, observer: Any = None) -> None:
        # One engine type below: a single engine core is a replicated engine of one replica.
        self.core = core if isinstance(core, ReplicatedEngine) else ReplicatedEngine.over(core)
        self.observer = observer
        self.stats = EngineStats()
        self.admitting = True
        self.dead: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None  # called on the event loop
        self._streams: dict[str, RequestStream] = {}  # by the client's request id
        # Their text, on the event loop; None without a tokenizer (outputs pass untouched).
        tokenizer = self.core.tokenizer
        self._text = OutputProcessor(tokenizer) if tokenizer is not None else None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.core.inbox.wake = self._wake.set  # a command (add, abort, attach...) wakes the loop
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None


    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self.stats = self._collect_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stops the thread (after the step in progress) and releases the workers."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.core.shutdown()

    def stop_admitting(self) -> None:
        self.admitting = False

    @property
    def num_active(self) -> int:
        """Requests whose client is still reading (a closed stream awaiting its abort is not)."""
        return sum(not s.finished for s in self._streams.values())

    def holds(self, request_id: str) -> bool:
        """Whether the id belongs to an active request (or one whose end is not yet confirmed)."""
        return request_id in self._streams

    async def wait_until_idle(self) -> None:
        await self._idle.wait()


    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Admits a request and returns its stream; raises what admission refuses it for."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if not self.admitting:
            raise NotAdmittingError("the server is draining and admits no new request")
        if request_id in self._streams:
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        stream = RequestStream(self, request_id)
        if lora is not None:
            stream.lora_name = lora.lora_name
        self._streams[request_id] = stream
        if self._text is not None and pooling is None:
            self._text.add_request(request_id, prompt_token_ids, params)
        self._idle.clear()
        command = AddRequest(request_id, list(prompt_token_ids), params, priority, cache_salt,
                             pooling, lora)
        self._send(command)
        try:
            await asyncio.wrap_future(command.admitted)
        except asyncio.CancelledError:
            # The caller went away while waiting: abort the request if it gets admitted, forget
            # the stream if it does not (then no output will ever come for it).
            stream.close()
            command.admitted.add_done_callback(lambda f: self._forget_if_refused(f, stream))
            raise
        except BaseException:
            stream.finished = True
            self._forget(stream)  # refused: the engine holds nothing of it
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Aborts active requests by client id; their streams end with finish_reason "abort".
        Returns the ids that were active."""
        active = [i for i in request_ids if i in self._streams and not self._streams[i].finished]
        if active:
            self._send(AbortRequests(active))
        return active

    def fail_all(self, error: Exception) -> None:
        """Ends every active stream with the error, for the server stopping now: its readers
        send the error to their clients instead of being cut off."""
        self._fail(list(self._streams), error)

    def _close(self, stream: RequestStream) -> None:
        """The reader went away: abort the request. The stream keeps its id until the engine's
        last output for it arrives (or its admission is refused)."""
        if self._text is not None:
            self._text.end(stream.request_id)
        self._send(AbortRequests([stream.request_id]))

    def _forget_if_refused(self, admitted: Future, stream: RequestStream) -> None:
        # Cancelled: the engine had not taken the command on yet, and now never admits it.
        if admitted.cancelled() or admitted.exception() is not None:
            # On the engine thread (or the loop's, when cancelled): hand over to the loop.
            self._call_soon(self._forget, stream)

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if self._text is not None:
                self._text.forget(stream.request_id)
        if not self._streams:
            self._idle.set()

    def _send(self, command: Command) -> None:
        self.core.inbox.put(command)


    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                pause = self.core.idle_wait_s()
                if pause is None:  # nothing to do until a command comes
                    self._wake.wait()
                    continue
                if pause > 0 and self._wake.wait(pause):
                    continue  # a command came: look again
                # Work, or the pause is over: requests waiting for a replica may be due, and a
                # step with nothing to run only notices the replicas that failed.
                try:
                    outputs = self.core.step()
                except NoReplicaError as e:  # some requests lost their replica; the rest go on
                    outputs = e.outputs
                    self._call_soon(self._fail, e.request_ids, e)
                # The stats and the outputs reach the loop in one call: whoever GetServerInfo
                # shows the engine idle reads metrics that count every request's end (_deliver).
                self._call_soon(self._publish, self._collect_stats(), outputs)
        except Exception as e:  # an engine bug: every request, present and future, fails
            logger.exception("the engine loop stopped")
            self._fail_pending(e)
            self._call_soon(self._die, e)

    def _fail_pending(self, error: Exception) -> None:
        dead = EngineDeadError(f"the engine stopped: {error}")
        for command in self.core.inbox.drain():
            if isinstance(command, AddRequest):
                refuse(command.admitted, dead)
        self.core.fail_parked(dead)  # the moved ones' streams end in _die

    def _publish(self, stats: EngineStats, outputs: list[EngineCoreOutput]) -> None:
        self.stats = stats
        if outputs:
            self._deliver(outputs)

    def _collect_stats(self) -> EngineStats:
        """Sums over the replicas' schedulers. The metrics count a step before GetServerInfo can
        report it, so a client that saw the engine idle reads metrics that include its last step."""
        schedulers = [r.core.scheduler for r in self.core.replicas]
        total = sum(s.kv.pool.num_blocks - 1 for s in schedulers)
        stats = EngineStats(
            num_running=sum(len(s.running) for s in schedulers),
            # Requests waiting for a replica (the grace period) wait too.
            num_waiting=sum(len(s.waiting) for s in schedulers) + len(self.core.parked),
            kv_blocks_total=total,
            kv_blocks_used=total - sum(s.kv.pool.num_free_blocks for s in schedulers),
            num_steps=sum(s.stats.num_steps for s in schedulers),
            num_preemptions=sum(s.stats.num_preemptions for s in schedulers),
            num_prefix_queries=sum(s.stats.num_prefix_queries for s in schedulers),
            num_prefix_hits=sum(s.stats.num_prefix_hits for s in schedulers),
            num_refused_requests=sum(s.stats.num_refused_requests for s in schedulers),
            num_spec_requests=sum(s.stats.num_spec_requests for s in schedulers),
            num_draft_tokens=sum(s.stats.num_draft_tokens for s in schedulers),
            num_accepted_tokens=sum(s.stats.num_accepted_tokens for s in schedulers),
            drafted_per_position=_sum_lists([s.stats.drafted_per_position for s in schedulers]),
            accepted_per_position=_sum_lists([s.stats.accepted_per_position for s in schedulers]))
        if self.observer is not None:
            self.observer.observe_engine(stats)
        return stats

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the server is gone and nobody is listening


    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs: text (the output processor), then each to its stream. The
        engine's last output for a request confirms its end (the stream forgets the id then)."""
        live = []
        for out in outputs:
            if out.request_id not in self._streams:
                continue
            if out.error is not None:  # the worker refused it: its stream fails, no one else's
                self._fail([out.request_id], RequestRefusedError(out.error))
                continue
            live.append(out)
        ended = [out for out in live if out.finished]  # the engine's ends, not a stop string's
        shown, stops = self._text.process(live) if self._text is not None else (live, {})
        for out in shown:
            stream = self._streams.get(out.request_id)
            if stream is not None and not stream.finished:  # else its reader went away
                stream._push(out)
                if stream.finished and self.observer is not None:
                    self.observer.observe_finished(stream, out)
        for out in ended:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                self._forget(stream)
                if stream.closed and self.observer is not None:
                    self.observer.observe_finished(stream, out)  # "abort"
        if stops:
            self._send(StopRequests(stops))

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """Ends these requests' streams with the error (the engine itself goes on)."""
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                if not stream.finished:
                    stream._push(error)
                self._forget(stream)

    def _die(self, error: Exception) -> None:
        self.dead = error
        dead = EngineDeadError(f"the engine stopped: {error}")
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream._push(dead)
            self._forget(stream)
        if self.on_dead is not None:
            self.on_dead(error)


def _sum_lists(lists: list[list[int]]) -> tuple[int, ...]:
    """Element-wise sums of lists of any lengths (a replica may not have drafted K yet)."""
    sums = [0] * max((len(x) for x in lists), default=0)
    for values in lists:
        for j, v in enumerate(values):
            sums[j] += v
    return tuple(sums)
