"""The Worker service, independent of transport: method name + request bytes in, reply bytes out.

Both servers (gRPC and ZMQ) call WorkerServicer.call(), so the protocol rules (the two-call step,
what a malformed request gets) and the mapping of errors to status codes live here, once.
Model work is serialised by a lock: the two transports may be used at the same time.

Who may call: with a worker token (`--worker-token-file`), every Worker method, GetInfo included,
needs the token the scheduler presents; a call without it or with another is refused with
UNAUTHENTICATED before its request is even parsed, so the batch is never touched. Health checks
are a service of their own and stay open (probes). With mutual TLS the handshake already admits
only the scheduler's certificate; a token then is checked as well.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from batchwire.common.key_file import WorkerToken
from batchwire.common.refusals import refusal_message
from batchwire.v1 import worker_pb2
from google.protobuf.message import DecodeError, Message

from worker_svc.batch.validation import InvalidStepError
from worker_svc.server.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

SERVICE_NAME = "batchwire.v1.Worker"


class WorkerCallError(Exception):
    """A call refused or failed; carries the status code the client receives."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def status_for(error: Exception) -> grpc.StatusCode:
    """The one place where an exception raised by a call becomes a status code."""
    if isinstance(error, WorkerCallError):
        return error.code
    if isinstance(error, InvalidStepError | DecodeError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class WorkerServicer:
    """Wraps a Worker (anything with get_info, execute_model, sample_tokens, reset)."""

    def __init__(
        self,
        worker: Any = None,
        on_shutdown: Callable[[], None] | None = None,
        metrics: WorkerMetrics | None = None,
        is_output_rank: bool = True,
        token: WorkerToken | None = None,
    ) -> None:
        self.token = token  # None: no token needed (loopback, or mutual TLS)
        self.worker = worker  # None while the model loads: calls get UNAVAILABLE
        self.on_shutdown = on_shutdown
        self.metrics = metrics
        # The rank whose replies the scheduler reads (TP rank 0 of the last pipeline stage).
        self.is_output_rank = is_output_rank
        self._lock = threading.Lock()
        self._parked = False  # ExecuteModel left logits for SampleTokens
        # ExecuteModel answered with its output (nothing scheduled, a pooling step, a stage that
        # handed its hidden states on): a SampleTokens after it takes the no-parked-state branch.
        self._answered = False
        # An ExecuteModel came since the last Reset: the batch may hold a scheduler's requests.
        self._holding = False
        self._last_call_end = time.monotonic()
        # Wire method -> (request type, handler taking the parsed request, returning a message).
        self.methods: dict[str, tuple[type[Message], Callable[[Any], Message]]] = {
            "GetInfo": (worker_pb2.GetInfoRequest, self._get_info),
            "ExecuteModel": (worker_pb2.SchedulerOutput, self._execute_model),
            "SampleTokens": (worker_pb2.GrammarOutput, self._sample_tokens),
            "Reset": (worker_pb2.ResetRequest, self._reset),
            "Shutdown": (worker_pb2.ShutdownRequest, self._shutdown),
        }

    def call(self, method: str, payload: bytes) -> bytes:
        """Runs one call (authorized already); raises WorkerCallError with the client's status
        code on any failure."""
        return self.run(method, self.parse(method, payload))

    def authorize(self, presented: str | bytes | None) -> None:
        """Raises UNAUTHENTICATED unless presented is the worker token (when one is set). Each
        server calls it first, on its own thread: a refused call never reaches the model thread."""
        if self.token is None:
            return
        if not presented:
            raise WorkerCallError(grpc.StatusCode.UNAUTHENTICATED,
                                  "missing worker token: this worker answers only a scheduler "
                                  "started with the same --worker-token-file")
        if not self.token.check(presented):
            raise WorkerCallError(grpc.StatusCode.UNAUTHENTICATED, "invalid worker token")

    def parse(self, method: str, payload: bytes) -> Message:
        entry = self.methods.get(method)
        if entry is None:
            raise WorkerCallError(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {method!r}")
        request_type = entry[0]
        try:
            return request_type.FromString(payload)
        except DecodeError as e:
            raise WorkerCallError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: {len(payload)} bytes are not a valid {request_type.__name__}: {e}",
            ) from e

    def run(self, method: str, request: Message) -> bytes:
        """Runs a parsed call, after any call in progress."""
        if self.worker is None:
            raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        self._lock.acquire()
        start = time.perf_counter()
        ok = False
        try:
            reply = self.methods[method][1](request).SerializeToString()
            ok = True
            return reply
        except WorkerCallError:
            raise
        except Exception as e:
            code = status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method)
            message = f"{method}: {e}"
            if isinstance(e, InvalidStepError):  # the requests at fault, for the scheduler
                message = refusal_message(message, e.req_ids)
            raise WorkerCallError(code, message) from e
        finally:
            self._last_call_end = time.monotonic()
            self._lock.release()
            if self.metrics is not None:
                self.metrics.observe(method, time.perf_counter() - start, request, ok)


    def _get_info(self, _: worker_pb2.GetInfoRequest) -> worker_pb2.WorkerInfo:
        return self.worker.get_info()

    def _execute_model(self, so: worker_pb2.SchedulerOutput) -> worker_pb2.ExecuteModelResponse:
        if self._parked:
            raise WorkerCallError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ExecuteModel(step_id={so.step_id}) before SampleTokens: the previous step's "
                "logits are still parked",
            )
        self._answered = False
        self._holding = True
        output = self.worker.execute_model(so)
        if output is None:
            self._parked = True
            return worker_pb2.ExecuteModelResponse()
        self._answered = True
        return worker_pb2.ExecuteModelResponse(output=output)

    def _sample_tokens(self, grammar: worker_pb2.GrammarOutput) -> worker_pb2.ModelRunnerOutput:
        if not self._parked:
            answered, self._answered = self._answered, False
            if self.is_output_rank and not answered:
                raise WorkerCallError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "SampleTokens with no ExecuteModel before it: nothing is parked",
                )
            return worker_pb2.ModelRunnerOutput()  # the walkthrough's no-parked-state branch
        try:
            output = self.worker.sample_tokens(grammar if grammar.req_ids else None)
        except InvalidStepError:
            raise  # a bad bitmask is refused before the logits are unparked: they stay parked
        except Exception:
            self._parked = False  # the runner unparked them before it failed
            raise
        self._parked = False
        return output

    def _reset(self, _: worker_pb2.ResetRequest) -> worker_pb2.ResetResponse:
        self.worker.reset()
        self._parked = self._answered = self._holding = False
        return worker_pb2.ResetResponse()

    def free_if_abandoned(self, after_s: float) -> bool:
        """Frees the batch, as Reset does, when it may hold requests and no call came for
        after_s: the scheduler that sent them has lost this worker (a partition, a crash) and
        resets it before any step should it come back. Whether it did."""
        with self._lock:
            idle_s = time.monotonic() - self._last_call_end
            if not self._holding or self.worker is None or idle_s < after_s:
                return False
            self._reset(worker_pb2.ResetRequest())
            return True

    def _shutdown(self, _: worker_pb2.ShutdownRequest) -> worker_pb2.ShutdownResponse:
        if self.on_shutdown is not None:
            self.on_shutdown()
        return worker_pb2.ShutdownResponse()
