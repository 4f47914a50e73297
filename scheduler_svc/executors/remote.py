"""What the gRPC and ZMQ executors share: the group's addresses (or a group started here), the
encoding of each call, replies read lazily, and the failure latch.

A call is sent to every rank at once; its future reads the replies when asked for the result, in
the calling thread, so a step costs no thread hand-off on this side. Every rank's reply is waited
for (the ranks stay in lockstep) but only the reply rank's payload is parsed. A watcher thread
probes the ranks every worker_heartbeat_s; a failed probe, a dead connection, a timeout or a
broken reply latches the executor failed: pending futures raise WorkerUnavailableError and later
calls raise it at once. One thread drives an executor.

Every call presents the worker token (`self.token`, from --worker-token-file or the group this
executor started); a worker that refuses it (UNAUTHENTICATED) fails the executor like a dead one,
with WorkerRefusedError, since no later call would be accepted either.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from batchwire.common.key_file import WorkerToken
from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import (
    FATAL_CODES,
    WorkerError,
    WorkerRefusedError,
    WorkerUnavailableError,
)
from scheduler_svc.executors.worker_group import LocalWorkerGroup

logger = logging.getLogger(__name__)


def _execute_model_reply(data: bytes) -> worker_pb2.ModelRunnerOutput | None:
    response = worker_pb2.ExecuteModelResponse.FromString(data)
    return response.output if response.HasField("output") else None


@dataclasses.dataclass(frozen=True, slots=True)
class WireMethod:
    name: str  # the gRPC method, and the first ZMQ frame
    encode: Callable[[tuple], bytes]
    decode: Callable[[bytes], Any]


def _message_or_empty(args: tuple) -> bytes:
    return b"" if not args or args[0] is None else args[0].SerializeToString()


WIRE_METHODS = {
    "get_info": WireMethod("GetInfo", _message_or_empty, worker_pb2.WorkerInfo.FromString),
    "execute_model": WireMethod("ExecuteModel", _message_or_empty, _execute_model_reply),
    "sample_tokens": WireMethod("SampleTokens", _message_or_empty,
                                worker_pb2.ModelRunnerOutput.FromString),
    "reset": WireMethod("Reset", _message_or_empty, lambda _: None),
    "shutdown": WireMethod("Shutdown", _message_or_empty, lambda _: None),
}

# A rank's outcome: the reply payload, or the error it answered with.
Outcome = bytes | WorkerError


SHUTDOWN_REPLY_S = 10.0  # the longest shutdown() waits for the workers to answer Shutdown


class Call(abc.ABC):
    """One call in flight to every rank of the group."""

    @abc.abstractmethod
    def wait(self) -> list[Outcome]:
        """Blocks until every rank answered; raises WorkerUnavailableError if the group failed."""

    def cancel(self) -> None:  # noqa: B027 - a transport may have nothing to cancel
        """Wakes a wait() blocked on this call, after the executor latched a failure."""

    def ready(self, timeout_s: float) -> bool:
        """Whether every rank has answered (wait() would not block), waiting up to timeout_s. A
        transport that answers within _send is always ready."""
        return True


class ReplyFuture(Future):
    """Resolved when someone asks: result() reads the replies in the asking thread, and so does
    wait_ready() once they are in."""

    def __init__(self, resolve: Callable[[ReplyFuture], None],
                 ready: Callable[[ReplyFuture, float], bool]) -> None:
        super().__init__()
        self._resolve = resolve
        self._ready = ready

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether result() would return at once, waiting up to timeout_s for the replies."""
        return self.done() or self._ready(self, timeout_s)

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._resolve(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._resolve(self)
        return super().exception(timeout)


def check_group(infos: Sequence[worker_pb2.WorkerInfo], addresses: Sequence[str]) -> int:
    """The group's output rank, once its ranks are known to be one P x T group in rank order."""
    ranks = [info.rank for info in infos]
    # Workers older than pipeline parallelism report 0 stages: one.
    shapes = {(info.pipeline_parallel_size or 1, info.tensor_parallel_size or 1, info.output_rank)
              for info in infos}
    if ranks != list(range(len(infos))) or len(shapes) != 1:
        raise ValueError(f"workers at {list(addresses)} are not one parallel group in rank "
                         f"order: ranks {ranks}, (stages, TP size, output rank) {sorted(shapes)}")
    ((pp, tp, output_rank),) = shapes
    if pp * tp != len(infos) or output_rank != (pp - 1) * tp:
        raise ValueError(f"workers at {list(addresses)}: {len(infos)} ranks for a group of "
                         f"{pp} stages x {tp} TP ranks with output rank {output_rank}")
    return output_rank


class RemoteExecutor(Executor):
    def __init__(self, config: SchedulerConfig, addresses: Sequence[str] | None = None) -> None:
        super().__init__(config, addresses)
        self.group: LocalWorkerGroup | None = None
        # Read again when the file changes, so a rotated token reaches calls already going out.
        token_file = config.worker_token_file
        self.token = WorkerToken.from_file(token_file) if token_file else None
        if addresses is None:
            if len(config.worker_addresses) > 1:
                raise ValueError(f"{len(config.worker_addresses)} worker groups configured: one "
                                 "executor drives one group; use the data-parallel engine")
            if config.worker_addresses:
                addresses = [a.strip() for a in config.worker_addresses[0].split(",")]
            else:
                self.group = LocalWorkerGroup.start(config.worker_config(),
                                                    token_file=token_file)
                addresses = self.group.addresses(self.transport)
                self.token = WorkerToken.from_file(self.group.token_file)
        self.addresses = list(addresses)
        if not self.addresses or not all(a.rpartition(":")[2].isdigit() for a in self.addresses):
            raise ValueError(f"worker addresses must be host:port, got {self.addresses}")
        self._failure: WorkerUnavailableError | None = None
        # The longest any one call may wait for its replies; shutdown() shortens it.
        self.rpc_timeout_s = config.worker_rpc_timeout_s
        self._pending: deque[tuple[Call, ReplyFuture, WireMethod, int | None]] = deque()
        self._pending_lock = threading.Lock()  # the watcher cancels what the caller appends
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            self._connect()
            self.infos: list[worker_pb2.WorkerInfo] = self.collective_rpc("get_info")
            self.output_rank = check_group(self.infos, self.addresses)
            # The scheduler owns the workers' state: requests of an earlier scheduler must go.
            self.collective_rpc("reset")
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name=f"{self.transport}-watch",
                                         daemon=True)
        self._watcher.start()


    def get_infos(self) -> list[worker_pb2.WorkerInfo]:
        return list(self.infos)  # read at connect time; a group's sizes do not change

    @abc.abstractmethod
    def _connect(self) -> None: ...

    @abc.abstractmethod
    def _send(self, method: str, payload: bytes, blocking: bool) -> Call:
        """Sends the call to every rank. `blocking`: the caller waits for the result right away,
        so the transport may do the whole call here."""

    @abc.abstractmethod
    def _probe(self) -> str | None:
        """One liveness check of every rank: None if all are fine, else what is wrong."""

    @abc.abstractmethod
    def _close(self) -> None: ...


    @property
    def failed(self) -> bool:
        return self._failure is not None

    def check_alive(self) -> None:
        failure = self._failure
        if failure is not None:  # a fresh error each time: one instance would pile up tracebacks
            raise type(failure)(failure.message, failure.rank, failure.address)

    def collective_rpc(self, method: str, args: tuple = (), non_block: bool = False,
                       unique_reply_rank: int | None = None) -> Any:
        wire = WIRE_METHODS.get(method)
        if wire is None:
            raise ValueError(f"{type(self).__name__} cannot call {method!r}: the Worker service "
                             f"has {sorted(WIRE_METHODS)}")
        self.check_alive()
        call = self._send(wire.name, wire.encode(args), not non_block and not self._pending)
        future = ReplyFuture(self._resolve_through, self._ready_through)
        with self._pending_lock:
            self._pending.append((call, future, wire, unique_reply_rank))
        return future if non_block else future.result()

    def shutdown(self) -> None:
        """Stops the group if this executor started it; otherwise leaves the workers running."""
        if self._closed.is_set():
            return
        self._closed.set()
        group, self.group = self.group, None
        asked = False
        if group is not None and self._failure is None:
            # The watcher has stopped, so nothing would notice a worker that exits without
            # answering: the reply is waited for no longer than the group's grace period.
            self.rpc_timeout_s = min(self.rpc_timeout_s, SHUTDOWN_REPLY_S)
            try:
                self.collective_rpc("shutdown")
                asked = True
            except WorkerError:
                pass
        self._fail_pending(WorkerUnavailableError("the executor was shut down"))
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()  # it may be using the transport's sockets
        self._close()
        if group is not None:
            group.stop(asked=asked)


    def _resolve_through(self, target: ReplyFuture) -> None:
        """Reads replies in call order up to and including `target`'s."""
        while not target.done() and self._resolve_first():
            pass

    def _ready_through(self, target: ReplyFuture, timeout_s: float) -> bool:
        """Reads the replies that are in, in call order, up to and including `target`'s; whether
        target's was among them. Waits up to timeout_s in all."""
        deadline = time.monotonic() + timeout_s
        while not target.done():
            with self._pending_lock:
                if not self._pending:
                    return target.done()  # shut down meanwhile: it holds the error
                call = self._pending[0][0]
            # A failed group's calls are "in": reading them raises at once.
            if self._failure is None and not call.ready(max(0.0, deadline - time.monotonic())):
                return False
            self._resolve_first()
        return True

    def _resolve_first(self) -> bool:
        """Reads the replies of the oldest call in flight; False when there is none."""
        with self._pending_lock:
            if not self._pending:
                return False
            call, future, wire, reply_rank = self._pending[0]
        try:
            future.set_result(self._result(call, wire, reply_rank))
        except BaseException as e:  # the future carries it to whoever asks
            future.set_exception(e)
        with self._pending_lock:
            if self._pending and self._pending[0][1] is future:
                self._pending.popleft()
        return True

    def _result(self, call: Call, wire: WireMethod, reply_rank: int | None) -> Any:
        self.check_alive()
        outcomes = call.wait()
        errors = [o for o in outcomes if isinstance(o, WorkerError)]
        if errors:
            fatal = [e for e in errors if e.code in FATAL_CODES]
            if fatal:
                kind = (WorkerRefusedError if fatal[0].code in WorkerRefusedError.CODES
                        else WorkerUnavailableError)
                self._fail(kind(f"{wire.name} failed: {fatal[0]}", fatal[0].rank,
                                fatal[0].address))
                self.check_alive()
            raise errors[0]
        try:
            if reply_rank is not None:
                return wire.decode(outcomes[reply_rank])  # type: ignore[arg-type]
            return [wire.decode(o) for o in outcomes]  # type: ignore[arg-type]
        except Exception as e:
            self._fail(WorkerUnavailableError(f"{wire.name}: unreadable reply: {e}"))
            self.check_alive()
            raise  # unreachable: check_alive raised


    def _fail(self, error: WorkerUnavailableError) -> None:
        if self._failure is None:
            self._failure = error
            if not self._closed.is_set():
                logger.error("%s executor for %s failed: %s", self.transport, self.addresses, error)
        with self._pending_lock:
            calls = [call for call, *_ in self._pending]
        for call in calls:
            call.cancel()

    def _fail_pending(self, error: WorkerUnavailableError) -> None:
        if self._failure is None:
            self._failure = error
        with self._pending_lock:
            pending, self._pending = list(self._pending), deque()
        for call, future, *_ in pending:
            call.cancel()
            if not future.done():
                future.set_exception(WorkerUnavailableError(self._failure.message))

    def _watch(self) -> None:
        period = self.config.worker_heartbeat_s
        while not self._closed.wait(period):
            if self._failure is not None:
                return
            problem = self._probe()
            if problem is not None and not self._closed.is_set():
                self._fail(WorkerUnavailableError(problem))
                return
